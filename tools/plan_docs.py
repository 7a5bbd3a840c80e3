"""Write docs/planner.md: the planner's output for every recipe, and for a config that does not fit.

    python tools/plan_docs.py [--out docs/planner.md] [--gpu h100-80gb]

Each recipe is planned at its own world size, as `mbridge pretrain --recipe NAME --plan-only`
prints it. Fine-tuning recipes get stand-in directories for their required paths (planning reads
no data).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

INTRO = """\
# Planning a run: memory, fit and time before any GPU is used

`mbridge pretrain|finetune --plan-only` (or `--dry-run`, which prints it after the config) plans
the resolved config: per distinct rank layout (pipeline stage) the bytes per GPU of

- **parameters, gradients and optimizer state**, as megatron-core allocates them: the DDP
  gradient buffers (fp32 with `grad_reduce_in_fp32`), with the distributed optimizer the parameter
  buffer and the rank's shard of fp32 main parameters and Adam moments, padding included;
  precision-aware optimizer dtypes, TP/PP/EP/ETP splits and vocabulary padding. For megatron-core's
  local layers these are exact: `tests/test_planner.py` trains eight layouts (TP 2, PP 2, PP 2 with
  virtual stages, distributed optimizer with DP 2, MoE with EP 2 and GPT-OSS's biases and attention
  sinks, bf16 with fp32 main parameters, several padded buckets, OLMo 2's norms at TP 2) under
  torchrun and compares with the bytes of the actual tensors on every rank;
- **activations** per micro batch (per-layer accounting after Korthikanti et al. 2022, generalized to
  grouped-query and multi-latent attention, gated MLPs, fused attention, MoE with shared experts,
  LoRA/DoRA adapters, the norms a layer
  has: before attention and MLP or not, after them, qk-norm per head or over whole projections; recompute
  none/selective/full, sequence and context parallelism) times the micro batches a stage holds in
  the 1F1B schedule (with interleaving: 2(p - rank - 1) + (v - 1)p + 1 chunks), plus a working set:
  for megatron-core's local layers the largest transient of a step (the score planes of the unfused
  softmax backward, or the 16-bit and fp32 logits of the cross entropy) and the score buffer of
  unfused attention, counted tensor by tensor as autograd keeps them (`tests/test_planner_activations.py`
  checks a layer's saved tensors, multi-latent attention's included, and the peak of a step on
  CPU); for TransformerEngine layers the fp32 logits of the last stage;
- a **fixed workspace allowance** of 4 GiB (CUDA context, NCCL/cuBLAS workspaces, fragmentation),
  shown as such: it is not derived from the config.

It says whether the config fits and by how much, and when it does not, ranked fixes: each is a
set of overrides, re-planned with the same planner (the tests apply every fix to the config,
resolve it and plan it again). Time: FLOPs per step from `flops_per_token`, step time and
tokens/s at a stated MFU (`--mfu`, default 0.40), time to `train_iters` and total tokens; the
pipeline bubble; DP, EP and expert-DP sizes. `--gpu` picks h100-80gb (default), h200-141gb,
a100-80gb or b200-180gb; `--plan-only --json` prints one record per rank layout.

Each plan says which layers it is for: what `provide()` builds on the GPUs planned for. As
`--plan-only` does, these plans take TransformerEngine as installed there, so they are of TE
layers, except for the recipes that ask for megatron-core's local layers (LoRA/DoRA, OLMo 2),
planned with SDPA core attention; `--no-te` plans local layers, `model.attention_backend=unfused`
megatron-core's unfused attention.
LoRA/DoRA runs: a frozen 16-bit base without gradients or optimizer state, buffers and optimizer
state for the adapters only (exact against the tensors of real runs in the tests). Multi-latent
attention has no `linear_qkv` (the default targets do not apply): its adapters are planned on the
projections named in `peft.target_modules` (`linear_q_proj` or `linear_q_down_proj` and
`linear_q_up_proj`, `linear_kv_down_proj`, `linear_kv_up_proj`, `linear_proj`).

Multi-token prediction (`model.mtp_num_layers`): each depth's norms, 2h -> h projection, transformer
layer (dense or MoE as the last decoder layer) and final norm on the last pipeline stage, which then
also holds a copy of the word embedding (and, tied, an output-layer weight megatron-core allocates
but does not use): exact against real runs in the tests. Activations: what each depth keeps as a
decoder layer does, its projection input and norms, and, since megatron-core computes the depths'
losses in the forward pass, the fp32 softmax of each depth's logits until the backward pass; the
peak also weighs the last depth's core-attention backward (measured on CPU). FLOPs count each
depth's layer and output layer. Not planned with MTP: LoRA/DoRA, full uniform recompute of more
than one layer per unit.

A real run is held against the same plan before it builds anything large: on CPU, its processes
against the memory this machine has available; on a GPU, each process's plan against the whole
memory of its GPU, once it has one. A plan larger than that is a configuration problem (exit 2
from `mbridge`), not minutes of building batches before an out-of-memory error.

Not modeled: communication time, TransformerEngine's FP8 caches, the optimizer's transient
buffers (inside the workspace allowance). With TE layers the parameter order, and so a few
elements of alignment padding, is TE's as far as it is known here, and the activations are those
planned before local layers were told apart (not measured without TE).

Regenerate this page with `python tools/plan_docs.py`.
"""


def verdict(p) -> str:
    w = p.worst
    parts = (
        f"parameters {w.state.params / 2**30:.1f} GiB + gradients {w.state.grads / 2**30:.1f} + optimizer "
        f"{w.state.optimizer / 2**30:.1f} + activations {w.activations.total / 2**30:.1f} + workspace "
        f"{w.workspace / 2**30:.0f}"
    )
    where = f" (fullest: stage {w.pp_rank})" if p.inputs.pp > 1 else ""
    if p.fits:
        return f"**Fits**, {w.margin / 2**30:.2f} GiB to spare{where}: {parts} = {w.total / 2**30:.1f} GiB."
    return f"**Does not fit**, {-w.margin / 2**30:.2f} GiB over{where}: {parts} = {w.total / 2**30:.1f} GiB."


def section(title: str, command: str, p) -> list[str]:
    return [f"## {title}", "", verdict(p), "", "```", f"$ {command}", *p.text(), "```", ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "planner.md"))
    ap.add_argument("--gpu", default="h100-80gb")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    from megatron_bridge.cli.dry_run import for_target
    from megatron_bridge.planning import plan
    from megatron_bridge.planning.inputs import PlanningError
    from megatron_bridge.training.config import runtime_config_update
    from recipes import get_recipe, list_recipes

    gpu_flag = "" if args.gpu == "h100-80gb" else f" --gpu {args.gpu}"
    lines = [INTRO]
    # resolved and planned as `--plan-only` does: for GPUs with TransformerEngine, whatever this machine has
    with tempfile.TemporaryDirectory() as tmp, for_target(True):
        stand_ins = dict(dataset_root=tmp, pretrained_checkpoint=tmp)
        for name in list_recipes():
            fn = get_recipe(name)
            options = stand_ins if name.endswith("_finetune_config") else {}
            cfg = fn(**options)
            runtime_config_update(cfg, world_size=fn.world_size)
            cmd = "finetune" if name.endswith("_finetune_config") else "pretrain"
            extra = " --recipe-arg dataset_root=DIR --recipe-arg pretrained_checkpoint=CKPT" if options else ""
            command = f"mbridge {cmd} --recipe {name} --plan-only{gpu_flag}{extra}"
            try:
                planned = plan(cfg, gpu=args.gpu, label=name)
            except PlanningError as exc:  # a recipe the planner does not model: say so
                lines += [f"## {name} on {fn.world_size} GPUs", "", f"Not planned: {exc}.", ""]
                continue
            lines += section(f"{name} on {fn.world_size} GPUs", command, planned)
    squeeze = dict(tensor_model_parallel_size=1, sequence_parallel=False, tp_comm_overlap=False)
    cfg = get_recipe("llama3_70b_pretrain_config")(**squeeze)
    with for_target(True):
        runtime_config_update(cfg, world_size=8)
        squeezed = plan(cfg, gpu=args.gpu, label="llama3_70b_pretrain_config")
    command = (
        "mbridge pretrain --recipe llama3_70b_pretrain_config --plan-only --world-size 8 "
        "--recipe-arg tensor_model_parallel_size=1 --recipe-arg sequence_parallel=false "
        "--recipe-arg tp_comm_overlap=false" + gpu_flag
    )
    lines += [
        "# A config that does not fit",
        "",
        "Llama 3 70B laid out for 64 GPUs, squeezed onto 8 at TP 1 (PP 4 x CP 2 remain). Only offloading the",
        "optimizer to the host fits at 8 GPUs; the planner then also looks for the smallest larger world",
        "size that fits without it.",
        "",
    ]
    lines += section(
        "llama3_70b_pretrain_config on 8 GPUs, TP 1",
        command,
        squeezed,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
