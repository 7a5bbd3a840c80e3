"""Data rules between config sections (no file access): packing against the model, blend
phases against the training length. A validation rule (`mbridge config rules`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_bridge.config.errors import Problems
from megatron_bridge.data.config import FinetuningDatasetConfig, GPTDatasetConfig
from megatron_bridge.data.phase_schedule import resolve_phases

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer


def check_data_rules(cfg: "ConfigContainer", problems: Problems) -> None:
    """Packed fine-tuning sequences fit the layout; blend phases fit the training length."""
    if isinstance(cfg.dataset, FinetuningDatasetConfig) and cfg.dataset.packed_sequence_specs is not None:
        check_packing(cfg, problems)
    if isinstance(cfg.dataset, GPTDatasetConfig) and cfg.dataset.blend_phases is not None:
        check_phase_schedule(cfg, problems)


def check_packing(cfg: "ConfigContainer", problems: Problems) -> None:
    data, m = cfg.dataset, cfg.model
    size = data.packed_sequence_specs.packed_sequence_size
    if size is not None and data.seq_length is not None:
        problems.check(
            size >= data.seq_length,
            "dataset.packed_sequence_specs.packed_sequence_size",
            f"{size} is shorter than dataset.seq_length={data.seq_length}, so a sample may not fit",
            f"use at least {data.seq_length} (or leave it unset to use dataset.seq_length)",
        )
        problems.check(
            m.seq_length is None or size <= m.seq_length,
            "dataset.packed_sequence_specs.packed_sequence_size",
            f"{size} exceeds model.seq_length={m.seq_length}",
            "pack to at most the model's sequence length",
        )
    problems.check(
        m.context_parallel_size == 1,
        "dataset.packed_sequence_specs",
        f"packed sequences are not split over context-parallel ranks (context_parallel_size={m.context_parallel_size})",
        "use context_parallel_size=1 with packing, or turn packing off",
    )
    if m.transformer_impl == "transformer_engine":
        problems.check(
            cfg.train.micro_batch_size == 1,
            "train.micro_batch_size",
            f"packed sequences go to TransformerEngine's attention one per micro batch, got micro_batch_size={cfg.train.micro_batch_size}",
            "set train.micro_batch_size=1 (a packed sequence already holds several samples)",
        )


def check_phase_schedule(cfg: "ConfigContainer", problems: Problems) -> None:
    data, t = cfg.dataset, cfg.train
    problems.check(
        data.dataloader_type in (None, "single"),
        "dataset.dataloader_type",
        f"{data.dataloader_type!r} reorders samples, so the blend phases would not start where they are set",
        "use dataloader_type='single' (or leave it unset) with blend_phases",
    )
    if t.train_iters is None:
        problems.add("dataset.blend_phases", "phases start at iterations, and the run is sample-based (train.train_samples)", "set train.train_iters")
        return
    problems.check(
        t.rampup_batch_size is None,
        "dataset.blend_phases",
        "phase boundaries are placed at iteration x global_batch_size samples, which batch-size ramp-up changes",
        "remove train.rampup_batch_size or the phases",
    )
    if data.blend is None or problems.at("dataset.blend_phases"):
        return
    resolve_phases(data.blend_phases, data.blend[1], t.train_iters, problems)
