"""Sequence packing for fine-tuning: several samples share one sequence of `packed_sequence_size`
tokens, so little of a batch is padding.

Attention never crosses a sample boundary and position ids restart at each sample. Where the
attention backend takes packed-sequence boundaries (TransformerEngine), batches carry
`cu_seqlens`; elsewhere (the local layers, on CPU) they carry a block-diagonal causal
`attention_mask`. Packing is best-fit decreasing (deterministic); the packed sequences are then
put in a seeded random order. Packed data is cached next to the data (`packed/` beside it, or
the `packed_*_data_path` files) and reused while the data, tokenizer and settings are the same.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
from typing import Any, Callable, Optional

import numpy as np
import torch

from megatron_bridge.data.samples import EpochOrder, Sample

logger = logging.getLogger(__name__)

CACHE_VERSION = 1


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of the items in each bin, best-fit decreasing: each item (longest first) goes to
    the fullest bin it fits in. Items keep their original order within a bin."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free: list[tuple[int, int]] = []  # (free capacity, bin id), sorted
    bins: list[list[int]] = []
    for i in order:
        need = lengths[i]
        if need > capacity:
            raise ValueError(f"item {i} has {need} tokens, more than the packed sequence size {capacity}")
        at = bisect.bisect_left(free, (need, -1))
        if at < len(free):
            room, b = free.pop(at)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - need > 0:
            bisect.insort(free, (room - need, b))
    return [sorted(b) for b in bins]


class PackedSamples:
    """Samples stored flat (ids, flags, offsets) and their grouping into packed sequences."""

    def __init__(self, ids: np.ndarray, flags: np.ndarray, offsets: np.ndarray, members: np.ndarray, member_offsets: np.ndarray):
        self.ids, self.flags, self.offsets = ids, flags, offsets
        self.members, self.member_offsets = members, member_offsets

    @classmethod
    def from_samples(cls, samples: list[Sample], capacity: int, seed: int) -> "PackedSamples":
        if not samples:
            raise ValueError("the fine-tuning data has no examples")
        # a sample of n tokens gives n - 1 (token, label) pairs
        bins = pack([len(ids) - 1 for ids, _ in samples], capacity)
        order = np.random.default_rng(seed).permutation(len(bins))
        bins = [bins[i] for i in order]
        lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return cls(
            ids=np.concatenate([ids for ids, _ in samples]).astype(np.int32),
            flags=np.concatenate([flags for _, flags in samples]).astype(np.uint8),
            offsets=offsets,
            members=np.array([i for b in bins for i in b], dtype=np.int64),
            member_offsets=np.concatenate([[0], np.cumsum([len(b) for b in bins])]).astype(np.int64),
        )

    def __len__(self) -> int:
        return len(self.member_offsets) - 1

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.flags[a:b]

    def bin(self, b: int) -> np.ndarray:
        return self.members[self.member_offsets[b] : self.member_offsets[b + 1]]

    def save(self, path: str, key: str) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            np.savez(f, version=CACHE_VERSION, key=digest_of(key), ids=self.ids, flags=self.flags, offsets=self.offsets, members=self.members, member_offsets=self.member_offsets)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str, key: str) -> Optional["PackedSamples"]:
        """The packed data at `path` if it was made with `key` (the same data and settings)."""
        try:
            with np.load(path) as z:
                if int(z["version"]) != CACHE_VERSION or str(z["key"]) != digest_of(key):
                    return None
                return cls(z["ids"], z["flags"], z["offsets"], z["members"], z["member_offsets"])
        except (OSError, KeyError, ValueError):
            return None


class PackedSFTDataset(torch.utils.data.Dataset):
    """Packed sequences of exactly `size` tokens (the rest is padding outside the loss, in a
    segment of its own). Items: tokens, labels, loss_mask, position_ids (restarting per sample)."""

    def __init__(self, packed: PackedSamples, size: int, num_samples: int, seed: int, pad_id: int, attention: str = "mask"):
        if attention not in ("mask", "cu_seqlens"):
            raise ValueError(f"attention must be 'mask' or 'cu_seqlens', got {attention!r}")
        self.packed = packed
        self.size = size
        self.order = EpochOrder(len(packed), num_samples, seed)
        self.pad_id = pad_id
        self.attention = attention

    def __len__(self) -> int:
        return self.order.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        size = self.size
        tokens = np.full(size, self.pad_id, dtype=np.int64)
        labels = np.full(size, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(size, dtype=np.float32)
        position_ids = np.zeros(size, dtype=np.int64)
        bounds = [0]
        at = 0
        for i in self.packed.bin(self.order(idx)):
            ids, flags = self.packed.sample(int(i))
            n = len(ids) - 1
            tokens[at : at + n] = ids[:-1]
            labels[at : at + n] = ids[1:]
            loss_mask[at : at + n] = flags[1:]
            position_ids[at : at + n] = np.arange(n)
            at += n
            bounds.append(at)
        if at < size:  # the padding: its own segment, outside the loss
            position_ids[at:] = np.arange(size - at)
            bounds.append(size)
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids, "bounds": np.asarray(bounds, dtype=np.int32)}

    def collate_fn(self, items: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        batch = {k: torch.from_numpy(np.stack([it[k] for it in items])) for k in ("tokens", "labels", "loss_mask", "position_ids")}
        if self.attention == "mask":
            batch["attention_mask"] = block_causal_mask(batch["position_ids"])
        else:
            most = max(len(it["bounds"]) for it in items)
            cu = torch.full((len(items), most), -1, dtype=torch.int32)
            for row, it in enumerate(items):
                cu[row, : len(it["bounds"])] = torch.from_numpy(it["bounds"])
            batch["cu_seqlens"] = cu
        return batch


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool mask, True where attention is blocked: a token sees the earlier tokens
    of its own sample only (a sample starts where its position id is 0)."""
    segment = torch.cumsum((position_ids == 0).to(torch.int32), dim=1)
    s = position_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    return ((segment[:, :, None] != segment[:, None, :]) | causal).unsqueeze(1)


# ---------------------------------------------------------------------- building and caching
def cache_path(source: Any, split: str, key: str, specs: Any) -> str:
    """Where the packed data of `split` is kept: `packed_train_data_path` / `packed_val_data_path`
    when set, else `packed/<split>_<hash>.npz` beside the data."""
    explicit = {"train": specs.packed_train_data_path, "valid": specs.packed_val_data_path}.get(split)
    if explicit:
        return os.fspath(explicit)
    base = os.path.dirname(os.path.abspath(source.files[0])) if source.files else source.dataset_dir
    return os.path.join(base, "packed", f"{split}_{digest_of(key)}.npz")


def digest_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def packed_dataset(tokenized: Callable[[], list[Sample]], key: str, source: Any, split: str, specs: Any, data: Any, num_samples: int, pad_id: int, attention: str) -> PackedSFTDataset:
    """The packed dataset of one split: from the cache when it matches, else tokenized and
    packed now (and cached unless `specs.on_the_fly`)."""
    size = specs.packed_sequence_size or data.seq_length
    key = f"{key}|pack={size}|seed={data.seed}"
    packed = None
    path = None if specs.on_the_fly else cache_path(source, split, key, specs)
    if path is not None and os.path.isfile(path):
        packed = PackedSamples.load(path, key)
        if packed is not None:
            logger.info("packed %s data: reusing %s", split, path)
    if packed is None:
        samples = tokenized()
        packed = PackedSamples.from_samples(samples, size, data.seed)
        logger.info("packed %d %s samples into %d sequences of %d tokens", len(samples), split, len(packed), size)
        if path is not None:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                packed.save(path, key)
            except OSError as exc:  # read-only data directory: packing still works, uncached
                logger.warning("cannot cache the packed %s data at %s (%s); packing at every start", split, path, exc)
    return PackedSFTDataset(packed, size, num_samples, data.seed, pad_id, attention)
