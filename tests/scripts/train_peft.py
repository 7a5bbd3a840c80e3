"""Fine-tune the tiny Llama-style test model with LoRA/DoRA via finetune(); write per-iteration
losses as JSON. Run as a plain process or under torchrun:
    torchrun --nproc_per_node=2 tests/scripts/train_peft.py --tp 2 --pretrained BASE --out losses.json
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from factories import sequence_parallel_layer_spec, tiny_config, tiny_llama_model  # noqa: E402

from megatron_bridge.peft import DoRA, LoRA  # noqa: E402
from megatron_bridge.training.callbacks import Callback  # noqa: E402
from megatron_bridge.training.config import CheckpointConfig, TrainingConfig, ValidationConfig  # noqa: E402
from megatron_bridge.training.finetune import finetune  # noqa: E402
from megatron_bridge.training.gpt_step import forward_step  # noqa: E402


class RecordLosses(Callback):
    def __init__(self):
        self.losses = []

    def on_step_end(self, state, metrics):
        if "lm loss" in metrics:
            self.losses.append(metrics["lm loss"])


def allow_sequence_parallel_on_cpu():
    """The CPU backend refuses sequence parallelism because megatron-core's torch norms do; with
    `sequence_parallel_layer_spec` the norms support it, so let the config through."""
    from megatron_bridge.runtime import cpu_backend

    adapt = cpu_backend.adapt_config

    def adapt_keeping_sequence_parallel(cfg, problems):
        cfg.model.sequence_parallel = False
        try:
            return adapt(cfg, problems)
        finally:
            cfg.model.sequence_parallel = True

    cpu_backend.adapt_config = adapt_keeping_sequence_parallel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--method", choices=["lora", "dora"], default="lora")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--exit-interval", type=int, default=None)
    p.add_argument("--dist-opt", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--sp-norms", action="store_true", help="layer spec whose norms allow sequence parallelism on CPU")
    p.add_argument("--pretrained", required=True)
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--backend", default="auto", help="dist.distributed_backend (tests: factories.backend_for)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cls = LoRA if args.method == "lora" else DoRA
    cfg = tiny_config(
        train=TrainingConfig(
            train_iters=args.iters, global_batch_size=8, micro_batch_size=2, exit_interval=args.exit_interval
        ),
        model=tiny_llama_model(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp),
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
        checkpoint=CheckpointConfig(pretrained_checkpoint=args.pretrained, save=args.save, load=args.load),
    )
    cfg.peft = cls(dim=8, alpha=16, dropout=args.dropout)
    if args.sp_norms or args.sequence_parallel:
        cfg.model.transformer_layer_spec = sequence_parallel_layer_spec
    if args.sequence_parallel:
        allow_sequence_parallel_on_cpu()
        cfg.model.sequence_parallel = True
    cfg.logger.log_interval = 1
    cfg.dist.distributed_backend = args.backend
    if args.dist_opt:
        cfg.ddp.use_distributed_optimizer = True
    recorder = RecordLosses()
    state = finetune(cfg, forward_step, callbacks=[recorder])
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump({"losses": recorder.losses, "step": state.train_state.step, "dp": cfg.data_parallel_size}, f)


if __name__ == "__main__":
    main()
