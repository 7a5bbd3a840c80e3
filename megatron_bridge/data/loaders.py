"""Dataloaders and the micro-batch iterators the train loop consumes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from megatron_bridge.data.samplers import CyclicSampler, GlobalBatchSampler, SequentialSampler

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer

logger = logging.getLogger(__name__)


class TrainingSetTooSmallError(ValueError):
    """The training set cannot fill even one global batch."""


def split_micro_batches(batches: Iterator[dict], micro_batch_size: int) -> Iterator[dict]:
    """Turn this rank's share of each global batch into micro batches."""
    for batch in batches:
        size = next(iter(batch.values())).shape[0]
        for start in range(0, size, micro_batch_size):
            yield {k: v[start : start + micro_batch_size] for k, v in batch.items()}


def choose_dataloader_type(cfg: "ConfigContainer", dataset: Any, needed: int) -> str:
    """The configured type, or a default: `single` when the dataset covers the run, else `cyclic`."""
    chosen = cfg.dataset.dataloader_type
    if chosen is not None:
        return chosen
    if not hasattr(dataset, "__len__") or len(dataset) >= needed:
        return "single"
    logger.info("dataset has %d samples for %d needed: dataloader_type='cyclic' (repeats, reshuffled)", len(dataset), needed)
    return "cyclic"


def build_iterator(
    cfg: "ConfigContainer",
    dataset: Any,
    consumed_samples: int,
    micro_batch_size: int,
    global_batch_size: int,
    needed_samples: int,
    dp_rank: int,
    dp_size: int,
    pin_memory: bool,
    collate_fn: Optional[Callable] = None,
    split: str = "train",
) -> Optional[Iterator[dict]]:
    """An iterator of micro batches for this data-parallel rank, starting at `consumed_samples`."""
    if dataset is None:
        return None
    kind = choose_dataloader_type(cfg, dataset, needed_samples)
    if kind == "external":
        return iter(dataset)
    size = len(dataset)
    if split == "train" and size < global_batch_size:
        raise TrainingSetTooSmallError(
            f"the training set has {size} samples, fewer than one global batch of {global_batch_size} "
            "(use more data or a smaller train.global_batch_size)"
        )
    data = cfg.dataset
    if kind == "single":
        sampler = SequentialSampler(size, consumed_samples, micro_batch_size, dp_rank, dp_size, data.drop_last)
    elif kind == "cyclic":
        seed = getattr(data, "random_seed", getattr(data, "seed", 0))
        sampler = CyclicSampler(size, consumed_samples, micro_batch_size, dp_rank, dp_size, data.data_sharding, seed)
    elif kind == "batch":
        sampler = GlobalBatchSampler(size, consumed_samples, micro_batch_size, global_batch_size, dp_rank, dp_size, data.drop_last)
    else:
        raise ValueError(f"dataset.dataloader_type: unknown {kind!r}")
    workers = data.num_workers
    # An own generator: starting an iterator draws a seed, which must not shift the training RNG
    # stream (a resumed run builds its iterators after restoring the RNG states).
    generator = torch.Generator()
    generator.manual_seed(getattr(data, "random_seed", getattr(data, "seed", 0)) + dp_rank)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory and data.pin_memory,
        persistent_workers=data.persistent_workers and workers > 0,
        multiprocessing_context=data.worker_start_method if workers > 0 else None,
        collate_fn=collate_fn if collate_fn is not None else getattr(dataset, "collate_fn", None),
        generator=generator,
    )
    iterator = iter(loader)
    if kind == "batch":
        return split_micro_batches(iterator, micro_batch_size)
    return iterator
