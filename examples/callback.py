"""A callback: hooks at train/eval start and end and around every step. This one keeps the best
validation loss and the training losses, and writes them to a JSON file at the end.

    python examples/callback.py --dir runs/example_callback --train-iters 40
"""

from __future__ import annotations

import argparse
import json
import os

from megatron_bridge.training.callbacks import Callback
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain
from recipes import tiny_gpt_pretrain_config


class BestValidation(Callback):
    """Records the training losses and the best validation loss (and its iteration)."""

    def __init__(self, path: str):
        self.path = path
        self.best, self.best_step = float("inf"), None
        self.losses: list[float] = []

    def on_step_end(self, state, metrics):
        self.losses.append(metrics["lm loss"])

    def on_eval_end(self, state, metrics):
        loss = metrics.get("lm loss")  # empty on ranks that do not hold the last pipeline stage
        if loss is not None and loss < self.best:
            self.best, self.best_step = loss, state.train_state.step
        self.write(state)  # also after the final evaluation, which follows on_train_end

    def write(self, state):
        if state.is_logging_rank:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "w") as f:
                json.dump({"best_validation_loss": self.best, "step": self.best_step, "train_losses": self.losses}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="runs", help="where checkpoints and logs go")
    parser.add_argument("--train-iters", type=int, default=100)
    args = parser.parse_args()

    cfg = tiny_gpt_pretrain_config(dir=args.dir, name="example_callback", train_iters=args.train_iters)
    cfg.validation.eval_interval = 10
    cfg.validation.test_iters = 0  # on_eval_end also sees the test split; keep to validation here
    best = BestValidation(os.path.join(args.dir, "example_callback", "best.json"))
    state = pretrain(cfg, forward_step, callbacks=[best])
    print(f"best validation loss {best.best:.4f} at iteration {best.best_step} (of {state.train_state.step})")


if __name__ == "__main__":  # the checkpoint writer re-imports this file in its helper processes
    main()
