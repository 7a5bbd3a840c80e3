"""Choosing the next token: greedy, or sampled with temperature, top-k and top-p.

Each prompt draws from its own generator, seeded with the seed and the prompt's index, so a
prompt's sample does not depend on which prompts share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron_bridge.config.errors import Problems

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen."""

    temperature: Optional[float] = None
    """0: greedy (the most likely token). Above 0: sample from the logits divided by it. Unset:
    greedy, or 1.0 when top_k or top_p is given."""

    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""

    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities add up to p (1.0: all)."""

    seed: int = 0
    """Seed of the samples (prompt i draws from a generator seeded with seed and i)."""

    def check(self) -> "Sampling":
        """This sampling, validated: raises one ConfigValidationError listing every problem."""
        problems = Problems()
        t = self.temperature
        problems.check(t is None or (t >= 0 and t == t and t != float("inf")), "temperature", f"must be 0 (greedy) or positive, got {t}", "e.g. 0.7")
        problems.check(self.top_k >= 0, "top_k", f"must be 0 (off) or positive, got {self.top_k}", "e.g. 50")
        problems.check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}", "e.g. 0.9")
        problems.check(0 <= self.seed < 2**63, "seed", f"must be in [0, 2**63), got {self.seed}", "e.g. 1234")
        if t == 0:
            problems.check(self.top_k == 0 and self.top_p == 1.0, "temperature",
                           "0 means greedy decoding, which top_k and top_p do not change",
                           "drop top_k/top_p, or sample with a temperature above 0")  # fmt: skip
        problems.raise_if_any()
        return self

    @property
    def greedy(self) -> bool:
        if self.temperature is None:
            return self.top_k == 0 and self.top_p == 1.0
        return self.temperature == 0

    def generators(self, first_index: int, count: int, device: torch.device) -> list[torch.Generator]:
        """Generators for prompts first_index .. first_index + count - 1."""
        import torch

        if self.greedy:
            return []
        out = []
        for i in range(first_index, first_index + count):
            g = torch.Generator(device=device)
            g.manual_seed((self.seed * 1_000_003 + i) % 2**63)
            out.append(g)
        return out

    def choose(self, logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """The next token of each row of `logits` [batch, vocab] -> [batch]."""
        import torch

        if self.greedy:
            return logits.argmax(dim=-1)
        scores = logits.float() / (self.temperature if self.temperature is not None else 1.0)
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
            drop = before >= self.top_p  # the most likely token always stays (before = 0)
            scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
        probs = scores.softmax(dim=-1)
        return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])
