"""Full fine-tuning vs LoRA (rank 16, alpha 32, the four projections) on the same model and batch,
side by side in one process on the CPU.

    python tools/bench_peft.py [--rounds 2] [--steps 4] [--layers 6] [--hidden 1024] [--dir /tmp/bench_peft]

Pretrains a Llama-style model of 100M+ parameters for one step and saves it as the base; then
alternates, `--rounds` times, a full fine-tune and a LoRA fine-tune of it with `finetune()`, each
for `--steps` timed steps after a warm-up step. Prints the median step time, trainable
parameters, optimizer-state bytes (Adam moments, and fp32 main weights where kept) and the size
of the checkpoint each writes, with LoRA's ratios to full fine-tuning. Goals: step time <= 0.8x,
optimizer state and checkpoint <= 2%.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes the optimizer keeps per parameter: its state tensors and any main-weight copies."""
    import torch

    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
        for group in getattr(opt, "fp32_from_float16_groups", []):
            total += sum(p.numel() * p.element_size() for p in group)
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="alternations of full and LoRA runs")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run (after one warm-up step)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=3584)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dir", default="/tmp/bench_peft")
    args = p.parse_args()

    import torch.nn.functional as F

    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.peft import LoRA
    from megatron_bridge.training.callbacks import Callback
    from megatron_bridge.runtime.checkpointing import layout
    from megatron_bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        MockGPTDatasetConfig,
        OptimizerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron_bridge.training.finetune import finetune
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    class Measure(Callback):
        def __init__(self):
            self.step_times, self.trainable, self.total, self.optimizer_bytes = [], 0, 0, 0

        def on_step_start(self, state):
            self.started = time.perf_counter()

        def on_step_end(self, state, metrics):
            self.step_times.append(time.perf_counter() - self.started)

        def on_train_end(self, state):
            params = {id(p): p for chunk in state.model for p in chunk.parameters()}.values()
            self.total = sum(p.numel() for p in params)
            self.trainable = sum(p.numel() for p in params if p.requires_grad)
            self.optimizer_bytes = optimizer_state_bytes(state.optimizer)

    def config(steps: int, save: str, pretrained=None, peft=None) -> ConfigContainer:
        model = GPTModelProvider(
            num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=16,
            num_query_groups=4, seq_length=args.seq, position_embedding_type="rope", normalization="RMSNorm",
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            share_embeddings_and_output_weights=False, hidden_dropout=0.0, attention_dropout=0.0,
            transformer_impl="local",
        )  # fmt: skip
        cfg = ConfigContainer(
            model=model,
            train=TrainingConfig(train_iters=steps, global_batch_size=args.batch, micro_batch_size=args.batch),
            optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-5),
            dataset=MockGPTDatasetConfig(seq_length=args.seq, num_workers=0),
            tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=args.vocab),
            validation=ValidationConfig(eval_iters=0),
            checkpoint=CheckpointConfig(save=save, pretrained_checkpoint=pretrained),
        )
        cfg.logger.log_interval = 1000
        cfg.peft = peft
        return cfg

    shutil.rmtree(args.dir, ignore_errors=True)
    base = os.path.join(args.dir, "base")
    base_cfg = config(1, base)
    base_cfg.checkpoint.save_optim = False
    pretrain(base_cfg, forward_step)

    runs = {"full": [], "lora": []}
    for round_ in range(args.rounds):
        for name in ("full", "lora"):
            save = os.path.join(args.dir, f"{name}{round_}")
            peft = LoRA(dim=16, alpha=32) if name == "lora" else None
            measure = Measure()
            finetune(config(1 + args.steps, save, pretrained=base, peft=peft), forward_step, callbacks=[measure])
            measure.checkpoint_bytes = dir_bytes(layout.iteration_dir(save, 1 + args.steps))
            runs[name].append(measure)
            shutil.rmtree(save)

    full, lora = runs["full"], runs["lora"]
    step = {k: statistics.median(t for m in v for t in m.step_times[1:]) for k, v in runs.items()}
    f, lo = full[-1], lora[-1]
    mb = 1e6
    print(
        f"model: {f.total / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, "
        f"vocab {args.vocab}), batch {args.batch} x {args.seq} tokens, fp32, 1 CPU process; "
        f"{args.rounds} alternations x {args.steps} timed steps"
    )
    rows = [
        ("step time (median)", f"{step['full']:.3f} s", f"{step['lora']:.3f} s", f"{step['lora'] / step['full']:.2f}x", "goal <= 0.8x"),
        ("trainable parameters", f"{f.trainable:,}", f"{lo.trainable:,}", f"{100 * lo.trainable / f.trainable:.2f}%", ""),
        ("optimizer state", f"{f.optimizer_bytes / mb:,.1f} MB", f"{lo.optimizer_bytes / mb:,.1f} MB",
         f"{100 * lo.optimizer_bytes / f.optimizer_bytes:.2f}%", "goal <= 2%"),
        ("checkpoint size", f"{f.checkpoint_bytes / mb:,.1f} MB", f"{lo.checkpoint_bytes / mb:,.1f} MB",
         f"{100 * lo.checkpoint_bytes / f.checkpoint_bytes:.2f}%", "goal <= 2%"),
    ]  # fmt: skip
    print(f"{'':22}{'full fine-tune':>18}{'LoRA rank 16':>18}{'LoRA / full':>14}")
    for label, a, b, ratio, goal in rows:
        print(f"{label:22}{a:>18}{b:>18}{ratio:>14}   {goal}".rstrip())
    per_round = [
        f"{statistics.median(a.step_times[1:]):.2f}/{statistics.median(b.step_times[1:]):.2f}"
        for a, b in zip(full, lora)
    ]
    print(f"median step seconds per round (full/LoRA): {', '.join(per_round)}")


if __name__ == "__main__":
    main()
