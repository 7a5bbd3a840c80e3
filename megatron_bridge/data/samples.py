"""A fine-tuning sample, and the order a dataset draws its samples in over several epochs."""

from __future__ import annotations

import numpy as np
import torch

Sample = tuple[np.ndarray, np.ndarray]
"""(token ids, flags): flags[i] is 1 when token i is one the loss covers (answer, assistant turn)."""


class EpochOrder:
    """Index -> item for `num_samples` draws over `size` items: in order for the first pass,
    then reshuffled each further pass with a seed that depends on the pass."""

    def __init__(self, size: int, num_samples: int, seed: int):
        self.size = size
        self.num_samples = max(num_samples, size)
        self.seed = seed

    def __call__(self, idx: int) -> int:
        epoch, position = divmod(idx, self.size)
        if epoch == 0:
            return position
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return int(torch.randperm(self.size, generator=g)[position])
