"""pretrain() against a hand-written megatron-core loop on one GPU, SDPA against unfused attention,
LoRA, each with the planner's memory estimate.

    python tools/bench_gpu.py [--rounds 2] [--iters 30] [--warmup 5] [--variants pretrain,unfused]
    python tools/bench_gpu.py --tiny          # tiny shape (automatic without CUDA): runs on CPU

Shape on a GPU: Llama-shaped, about 1.2B parameters (16 layers, hidden 2048, 32 heads, 8 key/value
groups, SwiGLU 8192, vocabulary 128256, tied embeddings), sequence 4096, bf16 with fp32 main
parameters and gradient reduction, micro batch 1, global batch 8 (8 micro batches per step).
TransformerEngine layers when TE imports; megatron-core's local layers otherwise, with the core
attention pretrain() chooses there (SDPA: no score matrix, so no selective recompute).

Variants (`--variants`, in the order given, alternating fresh processes per round):
  handwritten        GPTModel + DDP + get_megatron_optimizer + the pipeline schedule's
                     forward_backward_func (as bench_loops.py)
  pretrain           pretrain() with no trackers (attention_backend auto: SDPA on local layers)
  pretrain+trackers  pretrain() with every installed tracker (TensorBoard, W&B offline, MLflow on
                     sqlite, Comet offline) logging every iteration
  unfused            pretrain() with attention_backend=unfused and selective recompute of the scores
                     (megatron-core's local attention as it ran before SDPA)
  fused              pretrain() with megatron-core's fused SwiGLU (bias_activation_fusion) and
                     cross-entropy (cross_entropy_loss_fusion, native), both compiled by
                     torch.compile: the fusions local layers have without TransformerEngine
  lora               finetune() with LoRA rank 16 (alpha 32) on linear_qkv, linear_proj,
                     linear_fc1 and linear_fc2, from a base saved by a one-iteration run first
Each run prints its line as soon as it ends (median iteration time after warm-up, tokens/s and
MFU on a GPU, torch.cuda.max_memory_allocated next to the planner's estimate for the same config
without its fixed workspace allowance, which the allocator does not see), so a run cut short
still leaves figures; then the medians over all rounds, pretrain()/hand-written, trackers on/off,
unfused/SDPA, fused/plain and LoRA/full time per iteration. A variant that fails is reported and the others go
on (exit status 1 at the end).
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
VARIANTS = ("handwritten", "pretrain", "pretrain+trackers", "unfused", "fused", "lora")
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
        create_attention_mask=False,  # causal attention without a mask tensor, as pretrain() feeds it
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


def bench_config(shape: dict, variant: str, iters: int, te: bool, cuda: bool, workdir: str = ".", trackers=()):
    """The `ConfigContainer` a pretrain()/finetune() variant runs (unresolved): the shape above,
    bf16 mixed precision, mock data; `unfused` keeps megatron-core's DotProductAttention with
    selective recompute of the scores, `lora`/`lora-base` are the adapted run and its base."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.peft import LoRA
    from megatron_bridge.training.config import (
        CheckpointConfig, ConfigContainer, LoggerConfig, MockGPTDatasetConfig, OptimizerConfig, SchedulerConfig,
        TrainingConfig, ValidationConfig,
    )  # fmt: skip
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    logger_fields = {}
    if "tensorboard" in trackers:
        logger_fields["tensorboard_dir"] = f"{workdir}/tb"
    if "wandb" in trackers:
        logger_fields.update(wandb_project="bench", wandb_exp_name="bench", wandb_save_dir=f"{workdir}/wandb")
    if "mlflow" in trackers:
        logger_fields.update(
            mlflow_experiment="bench", mlflow_run_name="bench", mlflow_tracking_uri=f"sqlite:///{workdir}/mlflow.db"
        )
    if "comet" in trackers:
        logger_fields.update(
            comet_project="bench", comet_experiment_name="bench", comet_offline_directory=f"{workdir}/comet"
        )
    fields = model_fields(shape, te, cuda)
    for key in ("bf16", "params_dtype", "pipeline_dtype"):  # from the bf16_mixed preset
        fields.pop(key)
    if variant == "unfused":
        fields.update(attention_backend=AttnBackend.unfused, recompute_granularity="selective")
    if variant == "fused":
        fields.update(bias_activation_fusion=True, cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
    base = os.path.join(workdir, "base")
    cfg = ConfigContainer(
        model=GPTModelProvider(
            **fields,
            seq_length=shape["seq"],
            vocab_size=shape["vocab"],
            position_embedding_type="rope",
            rotary_base=500000,
            share_embeddings_and_output_weights=True,
        ),
        train=TrainingConfig(
            train_iters=1 if variant == "lora-base" else iters,
            global_batch_size=shape["gbs"],
            micro_batch_size=shape["mbs"],
        ),
        optimizer=OptimizerConfig(lr=3e-4, min_lr=3e-5, clip_grad=1.0),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0),
        dataset=MockGPTDatasetConfig(seq_length=shape["seq"], num_workers=0, split="1,0,0"),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=shape["vocab"]),
        validation=ValidationConfig(eval_iters=0),
        logger=LoggerConfig(log_interval=1 if trackers else max(1, iters), **logger_fields),
        mixed_precision="bf16_mixed",
    )
    if variant == "lora-base":  # weights only: what the adapted run starts from
        cfg.checkpoint = CheckpointConfig(save=base, save_optim=False, save_rng=False)
    elif variant == "lora":
        cfg.checkpoint = CheckpointConfig(pretrained_checkpoint=base)
        cfg.peft = LoRA(dim=16, alpha=32)  # the four projections of every layer
    return cfg


def with_pretrain(shape: dict, variant: str, iters: int, trackers: list[str], workdir: str) -> dict:
    """pretrain() (finetune() for `lora`) of `bench_config`, timed per iteration by a callback."""
    import torch

    from megatron_bridge.extras import is_installed
    from megatron_bridge.planning import activations, plan
    from megatron_bridge.planning.adapters import local_adapted
    from megatron_bridge.planning.devices import GPUS
    from megatron_bridge.training.callbacks import Callback
    from megatron_bridge.training.finetune import finetune
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    cuda = torch.cuda.is_available()
    te = te_available() and cuda and variant not in ("lora", "lora-base")  # adapters wrap local layers

    class Timing(Callback):
        def __init__(self):
            self.times, self.start, self.peak, self.layer_saved = [], 0.0, None, None

        def on_train_start(self, state):
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_step_start(self, state):
            self.start = time.perf_counter()

        def on_step_end(self, state, metrics):
            synchronize()
            self.times.append(time.perf_counter() - self.start)

        def on_train_end(self, state):
            self.peak = peak_memory()  # before the probe below
            if not te:
                self.layer_saved = saved_by_first_layer(state.model[0], shape)

    used = [name for name in trackers if is_installed(TRACKER_MODULES[name])]
    cfg = bench_config(shape, variant, iters, te, cuda, workdir, used)
    timing = Timing()
    (finetune if variant == "lora" else pretrain)(cfg, forward_step, callbacks=[timing])
    if variant == "lora-base":
        return {"iteration_times": timing.times, "max_allocated": None, "te": te}
    gpu = next(
        (g for g in GPUS.values() if cuda and g.name.split()[0] in torch.cuda.get_device_name()), GPUS["h100-80gb"]
    )
    p = plan(cfg, gpu=gpu.key, with_fixes=False)
    worst = p.worst
    inp = p.inputs
    layer_terms = activations.layer_terms(inp, False, None, inp.attention_masks[0], local_adapted(inp, 0))
    return {
        "iteration_times": timing.times,
        "max_allocated": timing.peak,
        "layer_saved": timing.layer_saved,
        "layer_planned": int(sum(layer_terms.values())),
        "te": te,
        "trackers": used,
        "planned_bytes": int(worst.total - worst.workspace),
        "planned_gpu": gpu.name,
        "core_attention": p.inputs.core_attention,
        "trainable": worst.state.trainable_elements,
    }


def saved_by_first_layer(chunk, shape: dict) -> int:
    """Bytes of the distinct tensors (parameters left out) that the first transformer layer of
    the trained model keeps for backward, for one micro batch of the bench shape: the planner's
    per-layer activation term, measured."""
    import torch

    model = chunk
    while not hasattr(model, "decoder"):
        model = model.module
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    first = model.decoder.layers[0]
    weight = next(first.parameters())
    hidden = torch.randn(shape["seq"], shape["mbs"], shape["hidden_size"], dtype=weight.dtype, device=weight.device)
    hidden.requires_grad_(True)
    rotary = model.rotary_pos_emb(shape["seq"]) if getattr(model, "rotary_pos_emb", None) is not None else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = first(hidden, attention_mask=None, rotary_pos_emb=rotary)
    del out
    return sum(saved.values())


# ---------------------------------------------------------------------- driver
def run_worker(variant: str, args: argparse.Namespace, workdir: str) -> dict:
    """One variant in a fresh process: its result, or {"error": ...} (the bench goes on)."""
    env = dict(
        os.environ,
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=workdir,
        MLFLOW_DISABLE_TELEMETRY="true",
        COMET_ERROR_TRACKING_ENABLE="false",
    )
    command = [
        sys.executable, os.path.abspath(__file__), "--worker", variant, "--iters", str(args.iters),
        "--workdir", workdir, "--trackers", args.trackers,
    ] + (["--tiny"] if args.tiny else [])  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir)
    line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH ")), None)
    if out.returncode != 0 or line is None:
        return {"error": f"exit {out.returncode}: {(out.stderr.strip() or out.stdout.strip())[-1500:]}"}
    return json.loads(line[len("BENCH ") :])


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        if variant == "lora":  # the frozen base, saved by its own short run
            base = run_worker("lora-base", args, workdir)
            if "error" in base:
                return {"error": f"saving the base failed, {base['error']}"}
        return run_worker(variant, args, workdir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shape (the default without CUDA)")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per variant (at least 1)")
    p.add_argument("--iters", type=int, default=30, help="training iterations per process (at least 1)")
    p.add_argument("--warmup", type=int, default=5, help="iterations left out of the medians")
    p.add_argument(
        "--variants",
        help=f"comma-separated variants to run, in this order, each round (default: {','.join(VARIANTS)}; "
        "without CUDA all but fused)",
    )
    p.add_argument(
        "--trackers",
        default=",".join(TRACKER_MODULES),
        help="trackers of the trackers-on variant, those installed of: %(default)s",
    )
    p.add_argument("--worker", choices=VARIANTS + ("lora-base",), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = set(filter(None, args.trackers.split(","))) - set(TRACKER_MODULES)
    if unknown:
        p.error(f"unknown trackers {sorted(unknown)}; choose from {', '.join(TRACKER_MODULES)}")
    variants = [v for v in (args.variants or ",".join(VARIANTS)).split(",") if v]
    wrong = [v for v in variants if v not in VARIANTS]
    if wrong or not variants:
        p.error(f"unknown variants {wrong}; choose from {', '.join(VARIANTS)}")
    for name in ("rounds", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: give at least 1")
    if not args.worker and not 0 <= args.warmup < args.iters:  # workers time every iteration they run
        p.error(f"--warmup {args.warmup}: give 0 or more, fewer than --iters ({args.iters}), so that iterations are timed")
    import torch

    cuda = torch.cuda.is_available()
    if args.variants is None and not cuda:
        variants.remove("fused")  # a GPU kernel; the default list is for GPUs
    if "fused" in variants and not cuda and not args.worker:
        p.error("the fused variant needs CUDA: megatron-core's fused SwiGLU and cross-entropy are GPU kernels")
    args.tiny = args.tiny or not cuda
    shape = TINY_SHAPE if args.tiny else GPU_SHAPE
    if args.worker:
        if args.worker == "handwritten":
            result = handwritten(shape, args.iters)
        else:
            trackers = args.trackers.split(",") if args.worker == "pretrain+trackers" else []
            result = with_pretrain(shape, args.worker, args.iters, trackers, args.workdir)
        print("BENCH " + json.dumps(result), flush=True)
        return
    report = Report(shape, args, cuda)
    print(report.header(), flush=True)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in variants:
            runs[variant].append(run_variant(variant, args))
            print(report.line(f"{variant} ({r + 1}/{args.rounds})", runs[variant][-1:]), flush=True)
    print("medians over all rounds:")
    for variant, results in runs.items():
        print(report.line(variant, results))
    for line in report.comparisons(runs):
        print(line)
    rounds = f"{args.rounds} rounds x {args.iters} iterations, first {args.warmup} left out, fresh processes"
    print(f"({rounds})", flush=True)
    if any("error" in r for results in runs.values() for r in results):
        raise SystemExit(1)


class Report:
    """The lines the bench prints: a header, one line per run or variant, the comparisons."""

    def __init__(self, shape: dict, args: argparse.Namespace, cuda: bool):
        from megatron_bridge.runtime.gpu_peaks import peak_tflops_for

        self.shape, self.warmup, self.cuda = shape, args.warmup, cuda
        self.device = torch_device_name() if cuda else "CPU"
        self.peak = peak_tflops_for(self.device) if cuda else None
        self.flops_per_token = model_flops_per_token(shape)
        self.tokens = shape["gbs"] * shape["seq"]

    def header(self) -> str:
        layers = "TransformerEngine" if (self.cuda and te_available()) else "megatron-core local, SDPA core attention"
        return (
            f"device: {self.device}; layers: {layers}; unfused: megatron-core's DotProductAttention with selective "
            f"recompute; lora: LoRA rank 16 on linear_qkv, linear_proj, linear_fc1, linear_fc2; shape: {self.shape}"
        )

    def median(self, results: list[dict]) -> float | None:
        times = [t for r in results if "error" not in r for t in r["iteration_times"][self.warmup :]]
        return statistics.median(times) if times else None

    def line(self, label: str, results: list[dict]) -> str:
        errors = [r["error"] for r in results if "error" in r]
        median = self.median(results)
        if median is None:
            return f"{label:18s} FAILED: {errors[0] if errors else 'no timed iterations'}"
        tps = self.tokens / median
        line = f"{label:18s} median {median * 1e3:9.2f} ms/iteration  {tps:12.0f} tokens/s"
        if self.peak and not label.startswith("lora"):  # model FLOPs count weight gradients LoRA skips
            line += f"  MFU {tps * self.flops_per_token / (self.peak * 1e12):.3f}"
        mem = [r["max_allocated"] for r in results if r.get("max_allocated") is not None]
        if mem:
            line += f"  max allocated {max(mem) / 2**30:.2f} GiB"
        planned = [r["planned_bytes"] for r in results if "planned_bytes" in r]
        if planned and mem:
            line += f"  planner {planned[0] / 2**30:.2f} GiB (measured/planned {max(mem) / planned[0]:.3f})"
        elif planned:
            line += f"  planner {planned[0] / 2**30:.4f} GiB (no CUDA: not measured)"
        layer = next((r for r in results if r.get("layer_saved")), None)
        if layer:
            line += (
                f"  layer 0 keeps {layer['layer_saved'] / 2**20:.2f} MiB for backward "
                f"(planned {layer['layer_planned'] / 2**20:.2f})"
            )
        if errors:
            line += f"  ({len(errors)} of {len(results)} runs failed)"
        return line

    def comparisons(self, runs: dict) -> list[str]:
        m = {v: self.median(results) for v, results in runs.items()}
        out = []
        if m.get("pretrain") and m.get("handwritten"):
            out.append(f"ratio pretrain()/hand-written per iteration: {m['pretrain'] / m['handwritten']:.3f}")
        if m.get("pretrain") and m.get("pretrain+trackers"):
            used = next((r["trackers"] for r in runs["pretrain+trackers"] if "trackers" in r), None)
            out.append(
                f"trackers on/off per iteration ({', '.join(used or ['none installed'])}, logging every iteration): "
                f"{m['pretrain+trackers'] / m['pretrain']:.3f}"
            )
        if m.get("pretrain") and m.get("unfused"):
            out.append(f"unfused/SDPA time per iteration: {m['unfused'] / m['pretrain']:.3f}")
        if m.get("pretrain") and m.get("fused"):
            out.append(f"fused/plain SwiGLU and cross-entropy time per iteration: {m['fused'] / m['pretrain']:.3f}")
        if m.get("pretrain") and m.get("lora"):
            out.append(f"LoRA/full training time per iteration: {m['lora'] / m['pretrain']:.3f}")
        return out


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
