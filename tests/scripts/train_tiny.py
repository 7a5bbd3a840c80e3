"""Train the tiny test model with pretrain(); write per-iteration losses as JSON.

Run as a plain process or under torchrun:
    torchrun --nproc_per_node=2 tests/scripts/train_tiny.py --tp 2 --out losses.json
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from factories import tiny_config, tiny_model  # noqa: E402

from megatron_bridge.training.callbacks import Callback  # noqa: E402
from megatron_bridge.training.config import TrainingConfig, ValidationConfig  # noqa: E402
from megatron_bridge.training.gpt_step import forward_step  # noqa: E402
from megatron_bridge.training.pretrain import pretrain  # noqa: E402


class RecordLosses(Callback):
    def __init__(self):
        self.losses = []

    def on_step_end(self, state, metrics):
        if "lm loss" in metrics:
            self.losses.append(metrics["lm loss"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--dist-opt", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = tiny_config(
        train=TrainingConfig(train_iters=args.iters, global_batch_size=args.gbs, micro_batch_size=args.mbs),
        model=tiny_model(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
    )
    cfg.logger.log_interval = 1
    cfg.dist.distributed_timeout_minutes = 2
    if args.dist_opt:
        cfg.ddp.use_distributed_optimizer = True
    recorder = RecordLosses()
    state = pretrain(cfg, forward_step, callbacks=[recorder])
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump({"losses": recorder.losses, "step": state.train_state.step, "dp": cfg.data_parallel_size}, f)


if __name__ == "__main__":
    main()
