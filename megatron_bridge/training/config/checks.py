"""The rules that span sections of a `ConfigContainer`: aliases, syncs, derived values, checks.

Each is a function `(cfg, problems)` declared, in the order it runs, in
`megatron_bridge.training.config.runtime.RULES`. `check_*` functions only report problems (they run
with the config read-only); values are computed in `derive_*` functions.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

import torch

from megatron_bridge.config.errors import Problems
from megatron_bridge.data.config import FinetuningDatasetConfig
from megatron_bridge.models.attention import backend_name
from megatron_bridge.models.vocab import null_tokenizer_vocab
from megatron_bridge.training.config.scheduler import ITERATION_FIELDS, SAMPLE_FIELDS
from megatron_bridge.training.mixed_precision import check_low_precision
from megatron_bridge.models.hf import checks as hf_checks
from megatron_bridge.training.config.run_rules import samples_after

if TYPE_CHECKING:
    from megatron_bridge.training.config.container import ConfigContainer

logger = logging.getLogger(__name__)

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
DETERMINISTIC_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
"""NCCL_ALGO values deterministic mode accepts: Megatron-LM's list (NVLS reductions are not
reproducible; '^NVLS' lets NCCL choose among the others)."""


# ---------------------------------------------------------------------- before sections finalize
def apply_deprecated_training_fields(cfg: "ConfigContainer", problems: Problems) -> None:
    """train.eval_iters / eval_interval / skip_train moved to `validation`; honour old configs."""
    for name in ("eval_iters", "eval_interval", "skip_train"):
        old = getattr(cfg.train, name)
        if old is None:
            continue
        if cfg.validation.is_explicit(name) and getattr(cfg.validation, name) != old:
            problems.add(
                f"train.{name}",
                f"{old!r} disagrees with validation.{name}={getattr(cfg.validation, name)!r}",
                f"set only validation.{name} (train.{name} is deprecated)",
            )
            continue
        logger.warning("train.%s is deprecated: using it as validation.%s=%r", name, name, old)
        cfg.validation.apply_default(name, old)


def sync_distributed_optimizer(cfg: "ConfigContainer", problems: Problems) -> None:
    """The distributed optimizer is one setting that lives in two sections (ddp and optimizer).
    The side the user set explicitly wins; if neither was set explicitly, "on" wins. Synced before
    the presets, which depend on it; each change is logged."""
    _sync_ddp_and_optimizer(cfg, problems, "use_distributed_optimizer")


def sync_overlap_param_gather(cfg: "ConfigContainer", problems: Problems) -> None:
    """Overlapped parameter gathering lives in ddp and optimizer, like the distributed optimizer;
    synced after the communication-overlap preset has set it."""
    _sync_ddp_and_optimizer(cfg, problems, "overlap_param_gather")


def sync_te_rng_tracker(cfg: "ConfigContainer", problems: Problems) -> None:
    """TransformerEngine's RNG tracker is one setting in two sections: rng.te_rng_tracker (what
    the run's seeding reads) and model.use_te_rng_tracker (megatron-core's name for it). As in
    NVIDIA Megatron Bridge, turning on either turns on both; the side set explicitly wins."""
    _sync_pair(cfg, problems, ("rng", "te_rng_tracker"), ("model", "use_te_rng_tracker"))


def _sync_ddp_and_optimizer(cfg: "ConfigContainer", problems: Problems, name: str) -> None:
    _sync_pair(cfg, problems, ("ddp", name), ("optimizer", name))


def _sync_pair(cfg: "ConfigContainer", problems: Problems, first: tuple[str, str], second: tuple[str, str]) -> None:
    """Make two fields holding one setting agree: a side the user set explicitly wins (both set
    and different is an error); if neither was set explicitly, "on" wins. Each change is logged."""
    (a_section, a_name), (b_section, b_name) = first, second
    a, b = getattr(cfg, a_section), getattr(cfg, b_section)
    a_value, b_value = getattr(a, a_name), getattr(b, b_name)
    if a_value == b_value:
        return
    a_explicit, b_explicit = a.is_explicit(a_name), b.is_explicit(b_name)
    if a_explicit and b_explicit:
        problems.add(
            f"{b_section}.{b_name}",
            f"{b_section}.{b_name}={b_value} but {a_section}.{a_name}={a_value}",
            "set both to the same value (or only one of them)",
        )
        return
    if a_explicit or (not b_explicit and a_value):
        value, target, name, changed = a_value, b, b_name, b_section
    else:
        value, target, name, changed = b_value, a, a_name, a_section
    logger.info("setting %s.%s=%s to match the other section", changed, name, value)
    target.apply_default(name, value)


# ---------------------------------------------------------------------- batch sizes
def check_batch_sizes(cfg: "ConfigContainer", problems: Problems) -> None:
    """The global batch size is a multiple of micro batch x data-parallel size (evaluation's too,
    and every batch size of a ramp-up)."""
    train, dp = cfg.train, cfg.data_parallel_size
    if dp is None or not train.micro_batch_size or not train.global_batch_size:
        return
    if train.rampup_batch_size is None:
        _check_divisible(problems, "train", train.global_batch_size, train.micro_batch_size, dp)
    elif not problems.at("train.rampup_batch_size"):
        # megatron-core asserts each batch size of the ramp divisible, mid-run, as it reaches it
        start, increment, _ = train.rampup_batch_size
        unit = train.micro_batch_size * dp
        problems.check(
            start % unit == 0 and increment % unit == 0,
            "train.rampup_batch_size",
            f"the ramp's batch sizes {start}, {start + increment}, ... are not all divisible by "
            f"micro_batch_size x data_parallel_size = {train.micro_batch_size} x {dp} = {unit}",
            f"use a start and an increment that are multiples of {unit}",
        )
    val = cfg.validation
    eval_sizes_given = not {"eval_micro_batch_size", "eval_global_batch_size"} <= val.derived_fields()
    if val.eval_iters and eval_sizes_given:  # derived from train's: already checked above
        _check_divisible(
            problems, "validation", val.eval_global_batch_size, val.eval_micro_batch_size, dp, prefix="eval_"
        )


def _check_divisible(problems: Problems, section: str, gbs: int, mbs: int, dp: int, prefix: str = "") -> None:
    unit = mbs * dp
    problems.check(
        gbs % unit == 0,
        f"{section}.{prefix}global_batch_size",
        f"{gbs} is not divisible by {prefix}micro_batch_size x data_parallel_size = {mbs} x {dp} = {unit}",
        f"use a multiple of {unit}, e.g. {max(unit, gbs // unit * unit)}",
    )


def check_pipeline_layout(cfg: "ConfigContainer", problems: Problems) -> None:
    """Layers split evenly over (virtual) pipeline stages; experts over expert-parallel ranks."""
    m = cfg.model
    pp, vp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
    uneven = m.num_layers_in_first_pipeline_stage is not None or m.num_layers_in_last_pipeline_stage is not None
    if pp > 1 and not uneven and m.pipeline_model_parallel_layout is None:
        stages = pp * (vp or 1)
        # account_for_embedding/loss_in_pipeline_split count the embedding and the loss as a layer each
        extra = int(bool(m.account_for_embedding_in_pipeline_split)) + int(bool(m.account_for_loss_in_pipeline_split))
        counted = f"{m.num_layers} layers + {extra} (embedding/loss)" if extra else f"{m.num_layers} layers"
        problems.check(
            (m.num_layers + extra) % stages == 0,
            "model.num_layers",
            f"{counted} do not split evenly over {pp} pipeline stages x {vp or 1} virtual stages",
            "change the pipeline sizes, set num_layers_in_first/last_pipeline_stage, or "
            "account_for_embedding/loss_in_pipeline_split",
        )
    if vp is not None and vp > 1:
        problems.check(
            pp > 1,
            "model.virtual_pipeline_model_parallel_size",
            f"virtual pipelining ({vp}) needs pipeline_model_parallel_size > 1",
            "raise the pipeline size or unset the virtual size",
        )
    if m.num_moe_experts:
        problems.check(
            m.num_moe_experts % m.expert_model_parallel_size == 0,
            "model.expert_model_parallel_size",
            f"{m.num_moe_experts} experts do not split over expert_model_parallel_size={m.expert_model_parallel_size}",
            "choose an EP size that divides the number of experts",
        )
        dp = cfg.data_parallel_size
        etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
        if dp is not None:
            ranks = dp * m.context_parallel_size * m.tensor_model_parallel_size
            problems.check(
                ranks % (m.expert_model_parallel_size * etp) == 0,
                "model.expert_model_parallel_size",
                f"DP x CP x TP = {ranks} ranks per pipeline stage is not divisible by "
                f"EP x expert TP = {m.expert_model_parallel_size} x {etp}",
                "choose EP so that it divides DP x CP x TP / expert TP",
            )


def check_distributed_optimizer_instances(cfg: "ConfigContainer", problems: Problems) -> None:
    """Each distributed-optimizer instance shards the state over an equal part of the DP x CP ranks;
    without the distributed optimizer there are no instances (megatron-core would only lose the
    overlap of its gradient all-reduce)."""
    instances, dp = cfg.ddp.num_distributed_optimizer_instances, cfg.data_parallel_size
    if instances == 1 or dp is None:
        return
    if not problems.check(
        cfg.ddp.use_distributed_optimizer,
        "ddp.num_distributed_optimizer_instances",
        f"{instances} instances of the distributed optimizer, but it is off (ddp.use_distributed_optimizer=False)",
        "set ddp.use_distributed_optimizer=True, or leave ddp.num_distributed_optimizer_instances at 1",
    ):
        return
    ranks = dp * cfg.model.context_parallel_size
    problems.check(
        ranks % instances == 0,
        "ddp.num_distributed_optimizer_instances",
        f"{instances} instances do not split the DP x CP = {ranks} ranks evenly",
        "choose a number of instances that divides DP x CP",
    )


# ---------------------------------------------------------------------- precision
def check_mixed_precision_consistency(cfg: "ConfigContainer", problems: Problems) -> None:
    """Model and optimizer agree on bf16/fp16; fp8/fp4 settings fit together."""
    m, opt = cfg.model, cfg.optimizer
    for name in ("bf16", "fp16"):
        problems.check(
            getattr(m, name) == getattr(opt, name),
            f"optimizer.{name}",
            f"model.{name}={getattr(m, name)} but optimizer.{name}={getattr(opt, name)}",
            f"set both alike, or use mixed_precision='{name}_mixed' which sets both",
        )
    preset = "use a preset such as mixed_precision='bf16_with_fp8_current_scaling_mixed'"
    check_low_precision(m, problems, "model.", preset)
    # bf16/fp16 select megatron-core's mixed-precision optimizer, which keeps fp32 main weights;
    # without them the fp32 optimizer steps the parameters themselves and needs them in fp32.
    half = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(m.params_dtype)
    if half is not None:
        problems.check(
            getattr(m, half),
            "model.params_dtype",
            f"{_dtype_name(m.params_dtype)} without model.{half}=True: the fp32 optimizer needs float32 parameters",
            f"use mixed_precision='{half}_mixed' ({half} weights with fp32 main weights in the optimizer), or leave "
            "model.params_dtype at float32",
        )
    else:
        problems.check(
            m.params_dtype == torch.float32,
            "model.params_dtype",
            f"{_dtype_name(m.params_dtype)}: megatron-core's optimizers train float32 parameters, or bf16/fp16 "
            "ones with mixed precision",
            "use float32, or mixed_precision='bf16_mixed' / 'fp16_mixed'",
        )


def _dtype_name(dtype: object) -> str:
    return str(dtype).replace("torch.", "")


def check_output_logits(cfg: "ConfigContainer", problems: Problems) -> None:
    """Training keeps the logits split over tensor-parallel ranks: megatron-core's loss (a
    vocabulary-parallel cross entropy) takes them so, and fails on gathered ones."""
    problems.check(
        cfg.model.parallel_output,
        "model.parallel_output",
        "False gathers the logits over tensor-parallel ranks, and megatron-core's training loss (its "
        "vocabulary-parallel cross entropy) takes them split (with gathered logits it fails in the backward pass)",
        "leave model.parallel_output=True for training (generation gathers the logits itself)",
    )


def check_initialization(cfg: "ConfigContainer", problems: Problems) -> None:
    """Weights left uninitialized (model.perform_initialization=False) are loaded from a checkpoint."""
    ckpt = cfg.checkpoint
    problems.check(
        cfg.model.perform_initialization or ckpt.load is not None or ckpt.pretrained_checkpoint is not None,
        "model.perform_initialization",
        "False leaves the weights uninitialized (whatever memory held), and no checkpoint is loaded into them",
        "set checkpoint.load or checkpoint.pretrained_checkpoint, or leave model.perform_initialization=True",
    )


# ---------------------------------------------------------------------- sequence
def check_sequence_lengths(cfg: "ConfigContainer", problems: Problems) -> None:
    """The dataset's sequence length matches the model's (fine-tuning: does not exceed it)."""
    data_seq = getattr(cfg.dataset, "seq_length", None)  # GPTDatasetConfig: its sequence_length; providers may lack one
    if data_seq is None:
        return
    model_seq = cfg.model.seq_length
    if isinstance(cfg.dataset, FinetuningDatasetConfig):
        ok = data_seq <= model_seq
        problem = f"dataset.seq_length={data_seq} exceeds model.seq_length={model_seq}"
    else:
        ok = data_seq == model_seq
        problem = f"model.seq_length={model_seq} but dataset sequence length is {data_seq}"
    problems.check(ok, "dataset.seq_length", problem, "set both to the same value")


def check_context_parallel(cfg: "ConfigContainer", problems: Problems) -> None:
    """Context parallelism: sequence length divisible by 2 x CP; valid communication kinds."""
    m = cfg.model
    cp = m.context_parallel_size
    if cp > 1:
        problems.check(
            m.seq_length % (2 * cp) == 0,
            "model.seq_length",
            f"{m.seq_length} is not divisible by 2 x context_parallel_size = {2 * cp}",
            f"use a multiple of {2 * cp}",
        )
    kinds = m.cp_comm_type
    kind_list = [] if kinds is None else kinds if isinstance(kinds, list) else [kinds]
    if isinstance(kinds, list) and not problems.at("model.cp_comm_type"):  # not again after megatron-core's check
        problems.check(
            len(kinds) == m.num_layers,
            "model.cp_comm_type",
            f"a per-layer list needs {m.num_layers} entries, got {len(kinds)}",
            "give one entry per layer or a single string",
        )
    bad = [k for k in kind_list if k not in CP_COMM_TYPES]
    problems.check(not bad, "model.cp_comm_type", f"unknown kind(s) {bad}", f"use {list(CP_COMM_TYPES)}")
    hierarchical = m.hierarchical_context_parallel_sizes
    if "a2a+p2p" in kind_list:
        if problems.check(
            hierarchical is not None,
            "model.hierarchical_context_parallel_sizes",
            "cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes",
            "set it, e.g. [2, 4] for context_parallel_size=8",
        ):
            product = math.prod(hierarchical)
            if problems.check(
                product == cp,
                "model.hierarchical_context_parallel_sizes",
                f"their product {product} differs from context_parallel_size={cp}",
                "make the sizes multiply to context_parallel_size",
            ):  # megatron-core lays out the hierarchical groups with einops
                problems.require_package(
                    "einops", "model.hierarchical_context_parallel_sizes", "megatron-core's hierarchical context-parallel groups"
                )
    elif hierarchical is not None:
        problems.add(
            "model.hierarchical_context_parallel_sizes",
            f"set to {hierarchical} but cp_comm_type is {kinds!r}",
            "use cp_comm_type='a2a+p2p' or unset hierarchical_context_parallel_sizes",
        )


def check_deterministic_mode(cfg: "ConfigContainer", problems: Problems) -> None:
    """Deterministic mode: no fused cross entropy, no TransformerEngine flash attention (as
    Megatron-LM: its backward pass is not deterministic), a deterministic NCCL algorithm. On local
    layers `flash` means PyTorch SDPA, as `auto` does, so it is kept there."""
    m = cfg.model
    if not m.deterministic_mode:
        return
    problems.check(
        not m.cross_entropy_loss_fusion,
        "model.cross_entropy_loss_fusion",
        "the fused cross entropy is not deterministic",
        "set model.cross_entropy_loss_fusion=False in deterministic mode",
    )
    problems.check(
        not (backend_name(m) == "flash" and m.transformer_impl == "transformer_engine"),
        "model.attention_backend",
        "TransformerEngine's flash attention is not deterministic",
        "set model.attention_backend='fused', 'unfused' or 'auto' in deterministic mode",
    )
    algo = os.environ.get("NCCL_ALGO", cfg.env_vars.get("NCCL_ALGO"))
    problems.check(
        algo in DETERMINISTIC_NCCL_ALGOS,
        "env_vars.NCCL_ALGO",
        f"deterministic mode needs NCCL_ALGO in {list(DETERMINISTIC_NCCL_ALGOS)}, got {algo!r}",
        "set env_vars={'NCCL_ALGO': 'Ring'}",
    )


def check_hugging_face(cfg: "ConfigContainer", problems: Problems) -> None:
    """Hugging Face weights to start from (config.json and index against the model config), and
    a model that `checkpoint.save_hf` can write."""
    hf_checks.check_pretrained(cfg, problems)
    hf_checks.check_save_hf(cfg, problems)


def check_vocab(cfg: "ConfigContainer", problems: Problems) -> None:
    """A vocabulary size the user set holds the NullTokenizer's tokens."""
    m, vocab = cfg.model, null_tokenizer_vocab(cfg)
    if vocab is not None and m.is_explicit("vocab_size"):
        problems.check(
            m.vocab_size >= vocab,
            "model.vocab_size",
            f"{m.vocab_size} is smaller than the tokenizer's {vocab}",
            "raise model.vocab_size or leave it unset to use the tokenizer's",
        )


def check_logger_outputs(cfg: "ConfigContainer", problems: Problems) -> None:
    """Logger outputs written next to the checkpoints."""
    problems.check(
        not cfg.logger.log_progress or cfg.checkpoint.save is not None,
        "logger.log_progress",
        "progress.txt is written into the checkpoint directory, and checkpoint.save is not set",
        "set checkpoint.save, or logger.log_progress=False",
    )
    if cfg.logger.log_energy:
        problems.require_package("pynvml", "logger.log_energy", "GPU energy logging")


# ---------------------------------------------------------------------- derived values
def derive_eval_batch_sizes(cfg: "ConfigContainer", problems: Problems) -> None:
    """Evaluation batch sizes default to the training ones."""
    train, val = cfg.train, cfg.validation
    if cfg.data_parallel_size is None or not train.micro_batch_size or not train.global_batch_size:
        return
    if val.eval_micro_batch_size is None:
        val._derive("eval_micro_batch_size", train.micro_batch_size)
    if val.eval_global_batch_size is None:
        val._derive("eval_global_batch_size", train.global_batch_size)


def derive_weight_decay(cfg: "ConfigContainer", problems: Problems) -> None:
    """The weight-decay schedule starts and ends at optimizer.weight_decay unless set; a constant
    schedule needs equal ends."""
    s, wd = cfg.scheduler, cfg.optimizer.weight_decay
    if s.start_weight_decay is None:
        s._derive("start_weight_decay", wd)
    if s.end_weight_decay is None:
        s._derive("end_weight_decay", wd)
    if s.weight_decay_incr_style == "constant":
        problems.check(
            s.start_weight_decay == s.end_weight_decay,
            "scheduler.end_weight_decay",
            f"constant weight decay but start ({s.start_weight_decay}) != end ({s.end_weight_decay})",
            "set weight_decay_incr_style='linear' or 'cosine', or make them equal",
        )
    elif s.start_weight_decay is not None and s.end_weight_decay is not None:
        problems.check(
            s.start_weight_decay <= s.end_weight_decay,
            "scheduler.start_weight_decay",
            f"start_weight_decay ({s.start_weight_decay}) exceeds end_weight_decay ({s.end_weight_decay})",
            "weight decay can only increase; swap them or use weight_decay_incr_style='constant'",
        )


def derive_scheduler_steps(cfg: "ConfigContainer", problems: Problems) -> None:
    """Scheduler lengths in samples, from iteration- or sample-based settings. Lengths given in
    iterations become the samples those iterations consume, which with a batch-size ramp-up is
    fewer than iterations x global_batch_size: the schedules end when the run does."""
    s, t = cfg.scheduler, cfg.train
    gbs = t.global_batch_size
    if not gbs or (t.train_iters is None and t.train_samples is None):
        return
    sample_based = t.train_samples is not None
    if sample_based:
        suffix, unit, kind, other_kind = "samples", "samples", "sample", "iteration"
    else:
        suffix, unit, kind, other_kind = "iters", "iterations", "iteration", "sample"
    other_fields = [n for n in (ITERATION_FIELDS if sample_based else SAMPLE_FIELDS) if getattr(s, n)]
    mixed = any(getattr(s, n) for n in (SAMPLE_FIELDS if sample_based else ITERATION_FIELDS))
    problems.check(  # fields mixed within the scheduler are reported by the scheduler alone
        not other_fields or mixed,
        f"scheduler.{other_fields[0]}" if other_fields else "scheduler",
        f"{kind}-based training (train.train_{suffix}) with {other_kind}-based scheduler fields {other_fields}",
        f"give scheduler lengths in {unit} (lr_decay_{suffix}, lr_warmup_{suffix}, lr_wsd_decay_{suffix})",
    )
    length = t.train_samples if sample_based else s.max_steps or t.train_iters
    decay_length = getattr(s, f"lr_decay_{suffix}") or length
    decay_field = f"lr_decay_{suffix}"
    if getattr(s, decay_field) is None and not s.is_explicit(decay_field):  # unset: shows the one in use
        s._derive(decay_field, decay_length)
    wsd_field = f"lr_wsd_decay_{suffix}"
    if s.lr_decay_style == "WSD" and getattr(s, wsd_field) is None and not s.is_explicit(wsd_field):
        s._derive(wsd_field, decay_length)  # unset: the whole decay is WSD's final phase
    warmup_length, wsd_length = getattr(s, f"lr_warmup_{suffix}"), getattr(s, wsd_field)
    if sample_based:
        total, decay, warmup, wsd = length, decay_length, warmup_length, wsd_length
    else:
        rampup = t.rampup_batch_size if not problems.at("train.rampup_batch_size") else None
        total, decay, warmup = (samples_after(n, gbs, rampup) for n in (length, decay_length, warmup_length))
        # WSD's final phase is the end of the decay: the samples of its last lr_wsd_decay_iters iterations
        wsd = decay - samples_after(decay_length - wsd_length, gbs, rampup) if wsd_length else None
    if s.lr_warmup_fraction is not None:
        # not rounded: megatron-core's scheduler takes a fractional warmup (Megatron-LM passes
        # fraction x decay samples as is), and rounding down would change every warmup LR
        warmup = s.lr_warmup_fraction * decay
    s._derive("lr_decay_steps", decay)
    s._derive("lr_warmup_steps", warmup)
    s._derive("wd_incr_steps", total)
    s._derive("wsd_decay_steps", wsd)
    # Lengths are reported as the user gave them. megatron-core's scheduler needs the warmup
    # shorter than the decay with every decay style (a constant LR is warmed up too).
    if s.lr_warmup_fraction is not None:
        problems.check(
            warmup < decay,
            "scheduler.lr_warmup_fraction",
            f"a warmup of {s.lr_warmup_fraction} of the decay ({decay_length} {unit}) leaves no decay",
            "use a fraction below 1",
        )
    else:
        problems.check(
            warmup < decay,
            f"scheduler.lr_warmup_{suffix}",
            f"warmup ({warmup_length} {unit}) is not shorter than the decay ({decay_length} {unit})",
            "shorten the warmup or lengthen lr_decay_iters / the training run",
        )
    if wsd is not None:
        problems.check(
            wsd_length <= decay_length,
            f"scheduler.lr_wsd_decay_{suffix}",
            f"the WSD decay phase ({wsd_length} {unit}) is longer than the whole decay ({decay_length} {unit})",
            f"shorten lr_wsd_decay_{suffix}",
        )
