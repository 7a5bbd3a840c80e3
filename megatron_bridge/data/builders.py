"""Build the train/valid/test datasets a config describes."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from megatron_bridge.data.config import DatasetBuildContext, DatasetProvider, FinetuningDatasetConfig, GPTDatasetConfig
from megatron_bridge.config.errors import Problems
from megatron_bridge.data.phase_schedule import resolve_phases
from megatron_bridge.data.finetuning import build_finetuning_datasets
from megatron_bridge.data.phases import build_phased_train_dataset

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleCounts:
    """How many samples each split must provide for the whole run."""

    train: int
    valid: int
    test: int


def sample_counts(cfg: "ConfigContainer") -> SampleCounts:
    """Train: every step's global batch; valid: `eval_iters` batches at every evaluation (each
    `eval_interval` steps and once at the end); test: `test_iters` (default `eval_iters`) batches."""
    t, v = cfg.train, cfg.validation
    train = t.train_samples if t.train_samples is not None else t.train_iters * t.global_batch_size
    eval_batch = v.eval_global_batch_size or t.global_batch_size
    evaluations = (t.train_iters // v.eval_interval if v.eval_interval else 0) + 1
    valid = (v.eval_iters or 0) * eval_batch * evaluations
    test_iters = v.test_iters if v.test_iters is not None else (v.eval_iters or 0)
    return SampleCounts(train=train, valid=valid, test=test_iters * eval_batch)


def resumed_sample_counts(cfg: "ConfigContainer", step: int, consumed_train: int, consumed_valid: int) -> SampleCounts:
    """The samples each split must provide for a job that starts at iteration `step`, after
    earlier jobs drew `consumed_train` and `consumed_valid` samples: those of `sample_counts`, or
    more where this config would need fewer than were drawn plus what is left to draw (a run
    extended with a larger eval_interval or a smaller global batch, a finished run evaluated
    again); the samplers start at the consumed counts, so the splits must reach past them.
    Resuming with the run's own config keeps `sample_counts`, so the data match an uninterrupted run."""
    counts = sample_counts(cfg)
    t, v = cfg.train, cfg.validation
    train = counts.train
    if t.train_samples is None:
        train = max(train, consumed_train + max(t.train_iters - step, 0) * t.global_batch_size)
    valid = counts.valid
    if v.eval_iters:
        eval_batch = v.eval_global_batch_size or t.global_batch_size
        later = (t.train_iters // v.eval_interval - step // v.eval_interval if v.eval_interval else 0) + 1  # the last: at the end
        valid = max(valid, consumed_valid + v.eval_iters * eval_batch * max(later, 1))
    return SampleCounts(train=train, valid=valid, test=counts.test)


def build_datasets(cfg: "ConfigContainer", tokenizer: Any, pg_collection: Any = None,
                   counts: Optional[SampleCounts] = None) -> tuple[Optional[Any], Optional[Any], Optional[Any]]:  # fmt: skip
    """(train, valid, test) datasets for `cfg.dataset`, of `counts` samples (default: `sample_counts`);
    a split may be None."""
    counts = counts if counts is not None else sample_counts(cfg)
    data = cfg.dataset
    if isinstance(data, DatasetProvider):
        context = DatasetBuildContext(
            train_samples=counts.train,
            valid_samples=counts.valid,
            test_samples=counts.test,
            tokenizer=tokenizer,
            pg_collection=pg_collection,
        )
        return _three_splits(data, data.build_datasets(context))
    if isinstance(data, FinetuningDatasetConfig):
        return build_finetuning_datasets(data, tokenizer, counts, cfg.model)
    if isinstance(data, GPTDatasetConfig):
        return _build_gpt_datasets(data, tokenizer, counts, cfg)
    raise TypeError(f"cfg.dataset: unsupported dataset config {type(data).__name__}")


def _three_splits(provider: DatasetProvider, returned: Any) -> tuple[Optional[Any], Optional[Any], Optional[Any]]:
    """What a user's `build_datasets` returned, as (train, valid, test); anything else is refused
    naming the provider (unpacking it would fail without saying whose result it was)."""
    if isinstance(returned, (tuple, list)) and len(returned) == 3:
        return tuple(returned)
    shown = f"{type(returned).__name__} of {len(returned)}" if isinstance(returned, (tuple, list)) else type(returned).__name__
    raise TypeError(
        f"cfg.dataset: {type(provider).__name__}.build_datasets returned a {shown}, not (train, valid, test); "
        "return a tuple of three datasets, with None for a split it does not provide"
    )


def resolved_phases(cfg: "ConfigContainer") -> Optional[list]:
    """The blend phases of `cfg` with start iterations (the first at 0); None without phases."""
    data = cfg.dataset
    if not isinstance(data, GPTDatasetConfig) or data.blend_phases is None or data.blend is None:
        return None
    problems = Problems()
    phases = resolve_phases(data.blend_phases, data.blend[1], cfg.train.train_iters, problems)
    problems.raise_if_any()
    return phases


def _build_gpt_datasets(data: GPTDatasetConfig, tokenizer: Any, counts: SampleCounts, cfg: Optional["ConfigContainer"] = None):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    config = copy.copy(data)  # the builder needs the tokenizer; the user's config keeps none
    config.apply_default("tokenizer", tokenizer)
    vocab = getattr(tokenizer, "vocab_size", None)
    config.apply_default("token_dtype_code", None if vocab is None else (4 if vocab > 65536 else 8))
    if data.skip_getting_attention_mask_from_dataset:  # the attention backend builds the causal mask
        config.apply_default("create_attention_mask", False)
    dataset_class = MockGPTDataset if config.mock else GPTDataset
    phases = resolved_phases(cfg) if cfg is not None and not config.mock else None
    if phases is not None:
        train = build_phased_train_dataset(config, phases, cfg.train.global_batch_size, counts.train)
        split = list(config.split_matrix)
        rest = copy.copy(config)
        rest.apply_default("split_matrix", [None, split[1] if counts.valid else None, split[2] if counts.test else None])
        _, valid, test = BlendedMegatronDatasetBuilder(dataset_class, [0, counts.valid, counts.test], lambda: True, rest).build()
        return train, valid, test
    sizes = [counts.train, counts.valid or None, counts.test or None]
    train, valid, test = BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config).build()
    return train, valid, test
