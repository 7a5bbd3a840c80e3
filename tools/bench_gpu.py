"""pretrain() against a hand-written megatron-core loop on one GPU, with the planner's memory estimate.

    python tools/bench_gpu.py [--rounds 2] [--iters 30] [--warmup 5]
    python tools/bench_gpu.py --tiny          # tiny shape (automatic without CUDA): runs on CPU

Shape on a GPU: Llama-shaped, about 1.2B parameters (16 layers, hidden 2048, 32 heads, 8 key/value
groups, SwiGLU 8192, vocabulary 128256, tied embeddings), sequence 4096, bf16 with fp32 main
parameters and gradient reduction, micro batch 1, global batch 8 (8 micro batches per step).
TransformerEngine layers when TE imports; megatron-core's local layers otherwise, with the core
attention pretrain() chooses there (SDPA: no score matrix, so no selective recompute).

Three variants, alternating fresh processes per round: the hand-written loop (GPTModel + DDP +
get_megatron_optimizer + the pipeline schedule's forward_backward_func, as bench_loops.py),
pretrain() with no trackers, and pretrain() with every installed tracker (TensorBoard, W&B
offline, MLflow on sqlite, Comet offline) logging every iteration. Prints per variant the median
iteration time after warm-up, tokens/s and MFU (GPU), torch.cuda.max_memory_allocated next to the
planner's estimate for the same config (without its fixed workspace allowance, which the
allocator does not see), the pretrain()/hand-written ratio, and trackers on/off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

GPU_SHAPE = dict(
    num_layers=16,
    hidden_size=2048,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=8192,
    vocab=128256,
    seq=4096,
    mbs=1,
    gbs=8,
)
TINY_SHAPE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=256,
    vocab=512,
    seq=128,
    mbs=1,
    gbs=4,
)
VARIANTS = ("handwritten", "pretrain", "pretrain+trackers")
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "comet": "comet_ml"}


def te_available() -> bool:
    from megatron_bridge.extras import is_installed

    return is_installed("transformer_engine")


def model_fields(shape: dict, te: bool, cuda: bool) -> dict:
    """TransformerConfig fields shared by both loops."""
    import torch
    import torch.nn.functional as F

    sizes = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")
    fields = dict(
        **{k: shape[k] for k in sizes}, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, transformer_impl="transformer_engine" if te else "local",
    )  # fmt: skip
    if not cuda:  # the settings the CPU backend applies to pretrain()'s model
        fields.update(
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            cross_entropy_loss_fusion=False,
        )
    return fields


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_memory() -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None


# ---------------------------------------------------------------------- the two loops (one per process)
def handwritten(shape: dict, iters: int) -> dict:
    from functools import partial

    import torch
    import torch.distributed as dist

    import megatron_bridge  # noqa: F401  (same warning filters as pretrain)
    from megatron_bridge.runtime import cpu_backend
    from megatron_bridge.runtime.distributed import free_port

    cuda = torch.cuda.is_available()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    else:
        cpu_backend.activate()
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bridge.runtime.tokenizers.tokenizer import NullTokenizer

    te = te_available() and cuda
    parallel_state.initialize_model_parallel()
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(**model_fields(shape, te, cuda))
    if te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:  # the core attention pretrain() builds for these layers
        from megatron_bridge.models.attention import replace_core_attention
        from megatron_bridge.models.sdpa_attention import SDPAttention

        spec = replace_core_attention(gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm"), SDPAttention)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape["vocab"],
        max_sequence_length=shape["seq"],
        position_embedding_type="rope",
        rotary_base=500000,
        share_embeddings_and_output_weights=True,
    )
    if cuda:
        gpt.cuda()
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=Float16Module(config, gpt),
    )
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-4, min_lr=3e-5, bf16=True, clip_grad=1.0), [model])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    data_config = GPTDatasetConfig(
        random_seed=1234, sequence_length=shape["seq"], reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, tokenizer=NullTokenizer(shape["vocab"]), split="1,0,0",
    )  # fmt: skip
    gbs, mbs = shape["gbs"], shape["mbs"]
    train_ds, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [iters * gbs, None, None], lambda: True, data_config
    ).build()
    batches = iter(
        torch.utils.data.DataLoader(
            train_ds, batch_size=mbs, shuffle=False, num_workers=0, drop_last=True, pin_memory=cuda
        )
    )
    device = torch.device("cuda" if cuda else "cpu")

    def loss_func(loss_mask, output):
        mask = loss_mask.view(-1).float()
        loss = torch.sum(output.float().view(-1) * mask)
        tokens = mask.sum().to(torch.int)
        return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1).float()])}

    def forward_step(data_iterator, model):
        b = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in next(data_iterator).items()}
        out = model(b["tokens"], b["position_ids"], b.get("attention_mask"), labels=b["labels"])
        return out, partial(loss_func, b["loss_mask"])

    fwd_bwd = get_forward_backward_func()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[model],
            num_microbatches=gbs // mbs,
            seq_length=shape["seq"],
            micro_batch_size=mbs,
            decoder_seq_length=shape["seq"],
            forward_only=False,
        )
        optimizer.step()
        synchronize()
        times.append(time.perf_counter() - start)
    return {"iteration_times": times, "max_allocated": peak_memory(), "te": te}


def with_pretrain(shape: dict, iters: int, trackers: list[str], workdir: str) -> dict:
    import torch

    from megatron_bridge.extras import is_installed
    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.planning import plan
    from megatron_bridge.planning.devices import GPUS
    from megatron_bridge.training.callbacks import Callback
    from megatron_bridge.training.config import (
        ConfigContainer, LoggerConfig, MockGPTDatasetConfig, OptimizerConfig, SchedulerConfig, TrainingConfig,
        ValidationConfig,
    )  # fmt: skip
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    cuda = torch.cuda.is_available()
    te = te_available() and cuda

    class Timing(Callback):
        def __init__(self):
            self.times, self.start = [], 0.0

        def on_train_start(self, state):
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_step_start(self, state):
            self.start = time.perf_counter()

        def on_step_end(self, state, metrics):
            synchronize()
            self.times.append(time.perf_counter() - self.start)

    used = [name for name in trackers if is_installed(TRACKER_MODULES[name])]
    logger_fields = {}
    if "tensorboard" in used:
        logger_fields["tensorboard_dir"] = f"{workdir}/tb"
    if "wandb" in used:
        logger_fields.update(wandb_project="bench", wandb_exp_name="bench", wandb_save_dir=f"{workdir}/wandb")
    if "mlflow" in used:
        logger_fields.update(
            mlflow_experiment="bench", mlflow_run_name="bench", mlflow_tracking_uri=f"sqlite:///{workdir}/mlflow.db"
        )
    if "comet" in used:
        logger_fields.update(
            comet_project="bench", comet_experiment_name="bench", comet_offline_directory=f"{workdir}/comet"
        )
    fields = model_fields(shape, te, cuda)
    for key in ("bf16", "params_dtype", "pipeline_dtype"):  # from the bf16_mixed preset
        fields.pop(key)
    cfg = ConfigContainer(
        model=GPTModelProvider(
            **fields,
            seq_length=shape["seq"],
            vocab_size=shape["vocab"],
            position_embedding_type="rope",
            rotary_base=500000,
            share_embeddings_and_output_weights=True,
        ),
        train=TrainingConfig(train_iters=iters, global_batch_size=shape["gbs"], micro_batch_size=shape["mbs"]),
        optimizer=OptimizerConfig(lr=3e-4, min_lr=3e-5, clip_grad=1.0),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0),
        dataset=MockGPTDatasetConfig(seq_length=shape["seq"], num_workers=0, split="1,0,0"),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=shape["vocab"]),
        validation=ValidationConfig(eval_iters=0),
        logger=LoggerConfig(log_interval=1 if used else max(1, iters), **logger_fields),
        mixed_precision="bf16_mixed",
    )
    timing = Timing()
    pretrain(cfg, forward_step, callbacks=[timing])
    gpu = next(
        (g for g in GPUS.values() if cuda and g.name.split()[0] in torch.cuda.get_device_name()), GPUS["h100-80gb"]
    )
    p = plan(cfg, gpu=gpu.key, with_fixes=False)
    worst = p.worst
    return {
        "iteration_times": timing.times,
        "max_allocated": peak_memory(),
        "te": te,
        "trackers": used,
        "planned_bytes": int(worst.total - worst.workspace),
        "planned_gpu": gpu.name,
    }


# ---------------------------------------------------------------------- driver
def run_variant(variant: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        env = dict(
            os.environ,
            WANDB_MODE="offline",
            WANDB_SILENT="true",
            WANDB_DIR=workdir,
            MLFLOW_DISABLE_TELEMETRY="true",
            COMET_ERROR_TRACKING_ENABLE="false",
        )
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            variant,
            "--iters",
            str(args.iters),
            "--workdir",
            workdir,
            "--trackers",
            args.trackers,
        ] + (["--tiny"] if args.tiny else [])
        out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir)
        line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH ")), None)
        if out.returncode != 0 or line is None:
            raise SystemExit(f"{variant} failed (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return json.loads(line[len("BENCH ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shape (the default without CUDA)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="iterations left out of the medians")
    p.add_argument(
        "--trackers",
        default=",".join(TRACKER_MODULES),
        help="trackers of the trackers-on variant, those installed of: %(default)s",
    )
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = set(filter(None, args.trackers.split(","))) - set(TRACKER_MODULES)
    if unknown:
        p.error(f"unknown trackers {sorted(unknown)}; choose from {', '.join(TRACKER_MODULES)}")
    import torch

    cuda = torch.cuda.is_available()
    args.tiny = args.tiny or not cuda
    shape = TINY_SHAPE if args.tiny else GPU_SHAPE
    if args.worker:
        if args.worker == "handwritten":
            result = handwritten(shape, args.iters)
        else:
            trackers = args.trackers.split(",") if args.worker == "pretrain+trackers" else []
            result = with_pretrain(shape, args.iters, trackers, args.workdir)
        print("BENCH " + json.dumps(result), flush=True)
        return
    if args.warmup >= args.iters:
        raise SystemExit("--warmup must be smaller than --iters")
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            runs[variant].append(run_variant(variant, args))
    report(runs, shape, args, cuda)


def report(runs: dict, shape: dict, args: argparse.Namespace, cuda: bool) -> None:
    from megatron_bridge.training.metrics import peak_tflops_for

    device = torch_device_name() if cuda else "CPU"
    peak = peak_tflops_for(device) if cuda else None
    flops_per_token = model_flops_per_token(shape)
    tokens = shape["gbs"] * shape["seq"]
    te = runs["handwritten"][0]["te"]
    print(
        f"device: {device}; layers: {'TransformerEngine' if te else 'megatron-core local, SDPA core attention'}"
        f"; shape: {shape}"
    )
    medians = {}
    for variant, results in runs.items():
        times = [t for r in results for t in r["iteration_times"][args.warmup :]]
        medians[variant] = statistics.median(times)
        tps = tokens / medians[variant]
        line = f"{variant:18s} median {medians[variant] * 1e3:9.2f} ms/iteration  {tps:12.0f} tokens/s"
        if peak:
            line += f"  MFU {tps * flops_per_token / (peak * 1e12):.3f}"
        mem = [r["max_allocated"] for r in results if r["max_allocated"] is not None]
        if mem:
            line += f"  max allocated {max(mem) / 2**30:.2f} GiB"
        planned = [r["planned_bytes"] for r in results if "planned_bytes" in r]
        if planned and mem:
            line += f"  planner {planned[0] / 2**30:.2f} GiB (measured/planned {max(mem) / planned[0]:.3f})"
        elif planned:
            line += f"  planner {planned[0] / 2**30:.4f} GiB (no CUDA: not measured)"
        print(line)
    print(f"ratio pretrain()/hand-written per iteration: {medians['pretrain'] / medians['handwritten']:.3f}")
    used = runs["pretrain+trackers"][0].get("trackers") or ["none installed"]
    print(
        f"trackers on/off per iteration ({', '.join(used)}, logging every iteration): "
        f"{medians['pretrain+trackers'] / medians['pretrain']:.3f}"
    )
    print(
        f"({args.rounds} rounds x {args.iters} iterations, first {args.warmup} left out, alternating fresh processes)"
    )


def torch_device_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def model_flops_per_token(shape: dict) -> float:
    """`flops_per_token` of the benchmark's model (tied embeddings, padded vocabulary)."""
    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.models.param_count import flops_per_token

    sizes = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")
    m = GPTModelProvider(
        **{k: shape[k] for k in sizes}, gated_linear_unit=True, add_bias_linear=False, normalization="RMSNorm",
        seq_length=shape["seq"], vocab_size=shape["vocab"], position_embedding_type="rope",
        share_embeddings_and_output_weights=True,
    )  # fmt: skip
    return flops_per_token(m, shape["seq"], shape["vocab"])


if __name__ == "__main__":
    main()
