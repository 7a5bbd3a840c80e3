"""Train one iteration of several tiny layouts with pretrain() and compare, on every rank, the bytes
megatron-core allocated for parameters, gradient buffers and optimizer state with the planner's.

    torchrun --nproc_per_node=2 tests/scripts/measure_memory.py --out result --layouts tp2 pp2 ...

Writes `<out>.rank<R>` (JSON): per layout, the measured and planned bytes of this rank and the
parameter list (name, numel) of the model and of the planner.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from factories import tiny_config, tiny_deepseek_model, tiny_model  # noqa: E402

from megatron_bridge.peft import DoRA, LoRA  # noqa: E402
from megatron_bridge.training.callbacks import Callback  # noqa: E402
from megatron_bridge.training.finetune import finetune  # noqa: E402
from megatron_bridge.training.config import TrainingConfig, ValidationConfig  # noqa: E402
from megatron_bridge.training.gpt_step import forward_step  # noqa: E402
from megatron_bridge.training.pretrain import pretrain  # noqa: E402

MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
    moe_grouped_gemm=False,
    moe_token_dispatcher_type="allgather",
    # GPT-OSS's parameters beyond the usual: biases on attention, router and experts, attention sinks
    add_bias_linear=True,
    softmax_type="learnable",
)

DENSE_MLA = dict(
    num_moe_experts=None, moe_layer_freq=1, moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None
)

LAYOUTS = {
    # name: (model fields, ddp fields, mixed precision preset); "tp2" also saves the base that the
    # PEFT layouts ("lora_", "dora_") adapt
    "tp2": (dict(tensor_model_parallel_size=2), {}, None),
    "pp2": (dict(pipeline_model_parallel_size=2, num_layers=4), {}, None),
    "dp2_distopt": (dict(), dict(use_distributed_optimizer=True), None),
    "moe_ep2": (dict(expert_model_parallel_size=2, **MOE), dict(use_distributed_optimizer=True), "bf16_mixed"),
    "bf16_fp32_main": (dict(), {}, "bf16_mixed"),
    # several buckets (bucket padding), untied output layer, odd vocabulary, qkv bias, qk norms
    "buckets_bf16": (
        dict(
            share_embeddings_and_output_weights=False,
            add_qkv_bias=True,
            qk_layernorm=True,
            vocab_size=250,
            add_bias_linear=False,
        ),
        dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=20000),
        "bf16_mixed",
    ),
    # no input norms, norms after attention and MLP, qk-norm over the whole projections (split over TP)
    "tp2_output_norms": (
        dict(
            tensor_model_parallel_size=2,
            normalization="RMSNorm",
            input_layernorms=False,
            output_layernorms=True,
            qk_layernorm=True,
            qk_layernorm_per_head=False,
            transformer_impl="local",
        ),
        {},
        None,
    ),
    # multi-latent attention with MoE (a shared expert) over EP 2; dense MLA with its latent
    # projections split over TP 2 (megatron-core trains MoE with TP only with sequence parallelism,
    # which local layers on CPU do not run)
    "mla_moe_ep2": (dict(expert_model_parallel_size=2), dict(use_distributed_optimizer=True), "bf16_mixed"),
    "mla_tp2": (dict(tensor_model_parallel_size=2, **DENSE_MLA), {}, None),
    "pp2_vp2_distopt": (
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=4),
        dict(use_distributed_optimizer=True),
        "bf16_mixed",
    ),
    # multi-token prediction: two depths on the last stage, which also holds the embedding they
    # look tokens up in (tied: reduced with the first stage's) and an output-layer weight of its own
    "mtp_pp2_distopt": (
        dict(pipeline_model_parallel_size=2, num_layers=4, mtp_num_layers=2),
        dict(use_distributed_optimizer=True),
        "bf16_mixed",
    ),
    # untied, virtual stages: the depths on the last chunk; the first stage's embedding is still
    # reduced with the last stage's copy
    "mtp_pp2_vp2_untied": (
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=4, mtp_num_layers=1,
             share_embeddings_and_output_weights=False),
        dict(use_distributed_optimizer=True),
        "bf16_mixed",
    ),
    # DeepSeek-V3's shape: one depth whose layer is a mixture of experts, as the last decoder layer
    "mla_moe_ep2_mtp": (
        dict(expert_model_parallel_size=2, mtp_num_layers=1),
        dict(use_distributed_optimizer=True),
        "bf16_mixed",
    ),
    # frozen base, adapters on the four projections split over TP (column: B and magnitude; row: A)
    "lora_tp2": (dict(tensor_model_parallel_size=2), {}, "bf16_mixed"),
    # some projections only, DoRA magnitudes, the distributed optimizer sharding the adapters
    "dora_dp2_distopt": (dict(), dict(use_distributed_optimizer=True), "bf16_mixed"),
    # multi-latent attention (the base mla_tp2 saves): every projection adapted, the latent down
    # projections column-parallel over TP 2 like the up projections
    "mla_dora_tp2": (dict(tensor_model_parallel_size=2, **DENSE_MLA), {}, "bf16_mixed"),
}
PEFT = {
    "lora_tp2": lambda: LoRA(dim=8, alpha=16),
    "dora_dp2_distopt": lambda: DoRA(dim=4, alpha=8, target_modules=["linear_qkv", "*.layers.1.*.linear_fc2"]),
    "mla_dora_tp2": lambda: DoRA(
        dim=4, alpha=8, target_modules=["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                                        "linear_kv_up_proj", "linear_proj"],
    ),  # fmt: skip
}
BASES = {"tp2": "base", "mla_tp2": "mla_base"}
"""The layouts that save the base a PEFT layout of their model adapts, and where (under --out)."""


def base_layout(peft_layout):
    return "mla_tp2" if peft_layout.startswith("mla") else "tp2"


def _storages(tensors):
    seen = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return seen


def measure(state):
    """Bytes of this rank's actual tensors: parameter storage, gradient buffers (main_grad),
    optimizer state (main parameter copies and moments) and torch's scalar step counters."""
    params = [p for chunk in state.model for p in chunk.parameters()]
    param_storages = _storages(params)
    grad_storages = _storages(getattr(p, "main_grad", None) for p in params)
    optimizers = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
    moments, steps, main = {}, {}, {}
    for opt in optimizers:
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                ptr = p.untyped_storage().data_ptr()
                if ptr not in param_storages and ptr not in grad_storages:
                    main[ptr] = p.untyped_storage().nbytes()  # an fp32 main copy of a 16-bit parameter
        for st in inner.state.values():
            for key, value in st.items():
                if torch.is_tensor(value):
                    target = steps if key == "step" and value.dim() == 0 else moments
                    target[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return {
        "params": sum(param_storages.values()),
        "grads": sum(grad_storages.values()),
        "optimizer": sum(main.values()) + sum(moments.values()),
        "step_counters": sum(steps.values()),
    }


def planned(cfg):
    from megatron.core import parallel_state as ps

    from megatron_bridge.planning.inputs import PlanInputs
    from megatron_bridge.planning.memory import stage_state
    from megatron_bridge.planning.params import chunk_params, chunks

    inp = PlanInputs.from_config(cfg)
    stage = chunks(inp)[ps.get_pipeline_model_parallel_rank()]
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    expert_dp_rank = ps.get_expert_data_parallel_rank()
    s = stage_state(inp, stage, dp_rank=dp_rank, expert_dp_rank=expert_dp_rank)
    names = [[p.name, p.numel] for c in stage for p in chunk_params(inp, c)]
    return {"params": s.params, "grads": s.grads, "optimizer": s.optimizer, "step_counters": s.step_counters}, names


class Measure(Callback):
    def __init__(self):
        self.result = None

    def on_train_end(self, state):
        plan, planned_names = planned(state.cfg)
        actual_names = []
        for chunk in state.model:
            for name, p in chunk.named_parameters():
                while name.startswith("module."):
                    name = name[len("module.") :]
                actual_names.append([name, p.numel()])
        self.result = {
            "measured": measure(state),
            "planned": plan,
            "names": actual_names,
            "planned_names": planned_names,
        }


def run_layout(name, out, backend):
    model_fields, ddp_fields, precision = LAYOUTS[name]
    cfg = tiny_config(
        train=TrainingConfig(train_iters=1, global_batch_size=4, micro_batch_size=1),
        model=(tiny_deepseek_model if name.startswith("mla") else tiny_model)(**model_fields),
        validation=ValidationConfig(eval_iters=0),
    )
    if "vocab_size" in model_fields:
        cfg.tokenizer.vocab_size = model_fields["vocab_size"]
    for key, value in ddp_fields.items():
        setattr(cfg.ddp, key, value)
    cfg.mixed_precision = precision
    # no log step where the depths' losses would be reduced: that hangs with PP > 1 on gloo
    cfg.logger.log_interval = 100 if model_fields.get("mtp_num_layers") else 1
    cfg.dist.distributed_backend = backend
    recorder = Measure()
    # megatron-core's trackers of the depths' and the MoE layers' losses are process-wide, sized by
    # the first run that fills them (a prediction depth's MoE layer is numbered after the decoder's)
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    get_moe_layer_wise_logging_tracker().clear()
    if name in PEFT:
        cfg.peft = PEFT[name]()
        cfg.checkpoint.pretrained_checkpoint = f"{out}.{BASES[base_layout(name)]}"
        finetune(cfg, forward_step, callbacks=[recorder])
        return recorder.result
    if name in BASES:
        cfg.checkpoint.save, cfg.checkpoint.save_optim, cfg.checkpoint.save_rng = f"{out}.{BASES[name]}", False, False
    pretrain(cfg, forward_step, callbacks=[recorder])
    return recorder.result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="tests: factories.backend_for")
    args = p.parse_args()
    # megatron-core 0.16 without TransformerEngine leaves this name undefined, and MoE routing
    # reads it (a NameError); the non-TE code path expects None.
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # One process group for all layouts: pretrain() joins it and leaves it up between runs.
    dist.init_process_group(args.backend)
    for name in args.layouts:
        if name in PEFT and base_layout(name) not in args.layouts[: args.layouts.index(name)]:
            raise SystemExit(f"{name} adapts the base the {base_layout(name)} layout saves: list it before")
    results = {name: run_layout(name, args.out, args.backend) for name in args.layouts}
    with open(f"{args.out}.rank{dist.get_rank()}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
