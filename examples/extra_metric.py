"""A custom forward step that logs an extra metric: next-token accuracy, next to `lm loss`, in
the trackers (TensorBoard here) every log step and on the console at each evaluation (the
console's training line shows only the metrics named "... loss").

    python examples/extra_metric.py --dir runs/example_metric --train-iters 20

A loss function returns (loss summed over tokens, token count, {name: [sum, count]}): every name
is averaged over micro batches and data-parallel ranks (sum / count) and logged.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from megatron_bridge.training.gpt_step import get_batch
from megatron_bridge.training.pretrain import pretrain
from recipes import tiny_gpt_pretrain_config


def loss_with_accuracy(labels, loss_mask, logits):
    # Full logits on this rank: fine without tensor parallelism (with TP the vocabulary is split).
    logits = logits.float()
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    mask = loss_mask.flatten().float()
    loss = (losses * mask).sum()
    count = mask.sum()
    correct = ((logits.argmax(-1).flatten() == labels.flatten()).float() * mask).sum()
    reports = {
        "lm loss": torch.stack([loss.detach(), count]),
        "token accuracy": torch.stack([correct, count]),
    }
    return loss, count.to(torch.int), reports


def forward_step(state, data_iterator, model):
    batch = get_batch(data_iterator, state)
    # Without labels the model returns logits ([batch, sequence, vocabulary]).
    logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    return logits, partial(loss_with_accuracy, batch["labels"], batch["loss_mask"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="runs", help="where checkpoints and logs go")
    parser.add_argument("--train-iters", type=int, default=100)
    args = parser.parse_args()

    cfg = tiny_gpt_pretrain_config(dir=args.dir, name="example_metric", train_iters=args.train_iters)
    cfg.logger.log_interval = 5
    state = pretrain(cfg, forward_step)
    print(f"trained {state.train_state.step} iterations")


if __name__ == "__main__":  # the checkpoint writer re-imports this file in its helper processes
    main()
