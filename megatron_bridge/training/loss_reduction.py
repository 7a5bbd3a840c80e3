"""Turn the per-micro-batch loss reports of the last pipeline stage into averages over the run."""

from __future__ import annotations

from typing import Optional

import torch


class LossAccumulator:
    """Sums (loss, tokens) pairs per metric over several steps without synchronizing; `average()`
    reduces once over the data-parallel group and returns token-weighted means."""

    def __init__(self) -> None:
        self.totals: dict[str, torch.Tensor] = {}

    def add(self, reports: list[dict]) -> None:
        """Add one step's reports (megatron-core's list of per-micro-batch dicts)."""
        for report in reports:
            for key, value in report.items():
                pair = value if value.numel() == 2 else torch.stack([value.float().view(()), torch.ones((), device=value.device)])
                if key in self.totals:
                    self.totals[key] = self.totals[key] + pair.detach().float()
                else:
                    self.totals[key] = pair.detach().float().clone()

    def average(self, group: Optional[torch.distributed.ProcessGroup]) -> dict[str, float]:
        """Token-weighted mean of each metric across steps and data-parallel ranks; resets."""
        if not self.totals:
            return {}
        keys = sorted(self.totals)
        stacked = torch.stack([self.totals[k] for k in keys])
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(stacked, group=group)
        self.totals = {}
        values = stacked.tolist()
        return {k: (v[0] / v[1] if v[1] > 0 else float("nan")) for k, v in zip(keys, values)}
