"""The training split of a blend whose weights change in phases (`dataset.blend_phases`).

Sample `i` of the run (the `i`-th sample drawn, counted over all steps) belongs to the phase
active at iteration `i // global_batch_size`. Each phase draws from the blend's datasets with its
own weights (megatron-core's blending helper), continuing each dataset where the previous phase
left it, so no sample is repeated at a switch. The whole map from sample number to (dataset,
sample) is a function of the config alone: a run resumed at any step draws exactly the samples
an uninterrupted run draws.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from typing import Any, Optional

import numpy as np
import torch

from megatron_bridge.data.phase_schedule import Phase, describe, phase_at
from megatron_bridge.runtime.callbacks import Callback

logger = logging.getLogger("megatron_bridge")


def blending_indices(phases: list[Phase], num_datasets: int, global_batch_size: int, total_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index, sample index within that dataset) of every sample of the run."""
    from megatron.core.datasets import helpers

    bounds = [p.start_iteration * global_batch_size for p in phases] + [total_samples]
    used = np.zeros(num_datasets, dtype=np.int64)
    dataset_index = np.empty(total_samples, dtype=np.int16)
    sample_index = np.empty(total_samples, dtype=np.int64)
    for phase, begin, end in zip(phases, bounds, bounds[1:]):
        size = end - begin
        if size <= 0:
            continue
        # only the datasets the phase draws from: megatron-core's helper gives a 0-weight dataset a sample
        active = np.flatnonzero(np.asarray(phase.weights) > 0)
        local = np.empty(size, dtype=np.int16)
        part_s = np.empty(size, dtype=np.int64)
        helpers.build_blending_indices(local, part_s, np.asarray(phase.weights, dtype=np.float64)[active], len(active), size, False)
        part_d = active[local].astype(np.int16)
        dataset_index[begin:end] = part_d
        sample_index[begin:end] = part_s + used[part_d]
        used += np.bincount(part_d, minlength=num_datasets)
    return dataset_index, sample_index


class PhasedBlendedDataset(torch.utils.data.Dataset):
    """Samples of a blend drawn phase by phase; items carry `dataset_id` like megatron-core's
    BlendedDataset."""

    def __init__(self, datasets: list[Optional[Any]], dataset_index: np.ndarray, sample_index: np.ndarray):
        self.datasets = datasets
        self.dataset_index = dataset_index
        self.sample_index = sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        dataset_id = int(self.dataset_index[idx])
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][int(self.sample_index[idx])]}


def _cached(config: Any, description: dict, build: Any) -> tuple[np.ndarray, np.ndarray]:
    """`build()`, saved to / loaded (memory-mapped) from `config.path_to_cache` when it is set."""
    cache = getattr(config, "path_to_cache", None)
    if not cache:
        return build()
    digest = hashlib.md5(json.dumps(description, sort_keys=True).encode(), usedforsecurity=False).hexdigest()
    paths = [os.path.join(cache, f"{digest}-PhasedBlendedDataset-{what}.npy") for what in ("dataset_index", "sample_index")]
    if all(os.path.isfile(p) for p in paths):
        return tuple(np.load(p, mmap_mode="r") for p in paths)  # type: ignore[return-value]
    arrays = build()
    os.makedirs(cache, exist_ok=True)
    for path, array in zip(paths, arrays):
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    return arrays


def build_phased_train_dataset(config: Any, phases: list[Phase], global_batch_size: int, total_samples: int) -> PhasedBlendedDataset:
    """The phased training dataset of `config.blend` (a finalized GPTDatasetConfig copy with the
    tokenizer set): one megatron-core GPTDataset per prefix, sized to what the phases draw."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    prefixes = list(config.blend[0])
    description = {"prefixes": prefixes, "phases": [[p.start_iteration, list(p.weights)] for p in phases], "gbs": global_batch_size, "samples": total_samples, "split": config.split, "seed": config.random_seed, "seq": config.sequence_length}
    dataset_index, sample_index = _cached(config, description, lambda: blending_indices(phases, len(prefixes), global_batch_size, total_samples))
    needed = np.zeros(len(prefixes), dtype=np.int64)
    for d in range(len(prefixes)):
        chosen = sample_index[dataset_index == d]
        needed[d] = int(chosen.max()) + 1 if chosen.size else 0
    datasets: list[Optional[Any]] = []
    for prefix, count in zip(prefixes, needed.tolist()):
        if count == 0:
            datasets.append(None)
            continue
        one = copy.copy(config)
        one.apply_default("blend", ([prefix], None))
        one.apply_default("split_matrix", [config.split_matrix[0], None, None])
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [count, None, None], lambda: True, one).build()
        datasets.append(train)
    return PhasedBlendedDataset(datasets, dataset_index, sample_index)


class PhaseAnnouncer(Callback):
    """Logs the active data phase when training starts and at every switch; the console's
    progress line shows it through `label`."""

    def __init__(self, phases: list[Phase], prefixes: list[str]):
        self.phases = phases
        self.prefixes = prefixes
        self.current: Optional[int] = None

    def label(self, iteration: int) -> str:
        index = phase_at(self.phases, iteration)
        return f"phase {index + 1}/{len(self.phases)} {self.phases[index].name}"

    def on_step_start(self, state: Any) -> None:
        index = phase_at(self.phases, state.train_state.step)
        if index != self.current:
            self.current = index
            if state.is_logging_rank:
                logger.info(describe(self.phases, index, self.prefixes))
