"""Batch samplers that shard samples over data-parallel ranks and resume at a sample count.

Each yields lists of dataset indices: one micro batch (`single`, `cyclic`) or this rank's share of
a global batch (`batch`). All start at `consumed_samples`, so a resumed run continues exactly
where the checkpoint left off, without repeating or skipping a sample.
"""

from __future__ import annotations

from typing import Iterator

import torch


def _check(total: int, consumed: int, micro_batch_size: int, rank: int, size: int) -> None:
    if total <= 0:
        raise ValueError(f"no samples to draw from (total={total})")
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    if not 0 <= rank < size:
        raise ValueError(f"data-parallel rank {rank} outside [0, {size})")
    if consumed < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed}")


class SequentialSampler:
    """`single`: one pass over the dataset in order; each step's `micro_batch_size x dp` samples
    are split over the data-parallel ranks."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, drop_last: bool = True):
        _check(total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        start = self.dp_rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(first + start, first + start + self.micro_batch_size))
        tail = (self.total_samples - self.consumed_samples) % step
        if tail and not self.drop_last:
            first = self.total_samples - tail
            own = list(range(first, self.total_samples))[start : start + self.micro_batch_size]
            if own:
                yield own


class CyclicSampler:
    """`cyclic`: endless passes, reshuffled every epoch with a seed that depends on the epoch, so
    any position can be recomputed from the consumed-sample count alone."""

    def __init__(self, dataset_size: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, data_sharding: bool = True, seed: int = 0):
        _check(dataset_size, consumed_samples, micro_batch_size, dp_rank, dp_size)
        self.dataset_size = dataset_size
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.data_sharding = data_sharding
        self.seed = seed
        self.step = micro_batch_size * dp_size
        self.usable = dataset_size - dataset_size % self.step
        if self.usable == 0:
            raise ValueError(
                f"the dataset has {dataset_size} samples, fewer than one step of micro_batch_size x "
                f"data-parallel size = {self.step}"
            )

    def __len__(self) -> int:
        return self.dataset_size

    def __iter__(self) -> Iterator[list[int]]:
        consumed = self.consumed_samples
        while True:
            epoch, offset = divmod(consumed, self.usable)
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            if self.data_sharding:
                # each rank draws from its own contiguous shard, shuffled within
                shard = self.usable // self.dp_size
                base = self.dp_rank * shard
                order = (base + torch.randperm(shard, generator=g)).tolist()
                position = offset // self.dp_size
                for i in range(position, shard - self.micro_batch_size + 1, self.micro_batch_size):
                    yield order[i : i + self.micro_batch_size]
                    consumed += self.step
            else:
                order = torch.randperm(self.usable, generator=g).tolist()
                for first in range(offset, self.usable - self.step + 1, self.step):
                    start = first + self.dp_rank * self.micro_batch_size
                    yield order[start : start + self.micro_batch_size]
                    consumed += self.step
            consumed = (epoch + 1) * self.usable


class GlobalBatchSampler:
    """`batch`: yields this rank's share of each global batch at once (`global_batch_size / dp`
    indices), so a collate function can pad the whole global batch to one length."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int, drop_last: bool = True):
        _check(total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size)
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size x dp "
                f"= {micro_batch_size * dp_size}"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_last = drop_last
        self.per_rank = global_batch_size // dp_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        start = self.dp_rank * self.per_rank
        for first in range(self.consumed_samples, self.total_samples - self.global_batch_size + 1, self.global_batch_size):
            yield list(range(first + start, first + start + self.per_rank))
        tail = (self.total_samples - self.consumed_samples) % self.global_batch_size
        if tail and not self.drop_last:
            first = self.total_samples - tail
            own = list(range(first, self.total_samples))[start : start + self.per_rank]
            if own:
                yield own
