"""Scoring sequences: the log-probability the model gives each of their tokens.

Each `corpora.Scored` sequence is token ids with a weight per token: weight 1 on token t counts
log p(token t | tokens before it) (the first token has no prediction). Sequences are run in
batches of similar lengths, padded on the right (the causal mask keeps padding out of the real
tokens' view), without a cache: one forward per batch.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from megatron_bridge.inference.corpora import Scored
from megatron_bridge.inference.model import InferenceModel


def token_logprobs(model: InferenceModel, sequences: Sequence[Scored], batch_size: int = 8) -> list[np.ndarray]:
    """For each sequence, log p(ids[t] | ids[:t]) for t = 1 .. len-1 (float64, one per
    prediction), computed in batches of at most `batch_size` sequences of similar length."""
    out: list[np.ndarray] = [np.zeros(0)] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].ids))
    with model.evaluating():
        for start in range(0, len(order), batch_size):
            rows = [i for i in order[start : start + batch_size] if len(sequences[i].ids) >= 2]
            if not rows:
                continue
            for i, values in zip(rows, _batch_logprobs(model, [sequences[i].ids for i in rows])):
                out[i] = values
    return out


def _batch_logprobs(model: InferenceModel, batch: list[np.ndarray]) -> Iterable[np.ndarray]:
    length = max(len(ids) for ids in batch) - 1
    inputs = torch.zeros(len(batch), length, dtype=torch.long)
    targets = torch.zeros(len(batch), length, dtype=torch.long)
    for row, ids in enumerate(batch):
        t = torch.as_tensor(ids, dtype=torch.long)
        inputs[row, : len(ids) - 1] = t[:-1]
        targets[row, : len(ids) - 1] = t[1:]
    device = model.device
    inputs, targets = inputs.to(device), targets.to(device)
    positions = torch.arange(length, device=device).expand(len(batch), length)
    logits = model.logits(inputs, positions, None)
    logprobs = torch.log_softmax(logits.double(), dim=-1).gather(-1, targets[..., None])[..., 0].cpu().numpy()
    return [logprobs[row, : len(ids) - 1] for row, ids in enumerate(batch)]


def nll_total(sequences: Sequence[Scored], logprobs: Sequence[np.ndarray]) -> tuple[float, int]:
    """(summed negative log-likelihood of the counted tokens, how many were counted)."""
    total, count = 0.0, 0
    for seq, values in zip(sequences, logprobs):
        weights = seq.weights[1:]
        if len(values):
            total -= float(np.dot(weights, values))
            count += int(weights.sum())
    return total, count
