"""Train the tiny test model with pretrain(); write per-iteration losses as JSON.

Run as a plain process or under torchrun:
    torchrun --nproc_per_node=2 tests/scripts/train_tiny.py --tp 2 --out losses.json
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from factories import tiny_config, tiny_model  # noqa: E402

from megatron_bridge.training.callbacks import Callback  # noqa: E402
from megatron_bridge.training.config import TrainingConfig, ValidationConfig  # noqa: E402
from megatron_bridge.training.gpt_step import forward_step  # noqa: E402
from megatron_bridge.training.pretrain import pretrain  # noqa: E402


class RecordLosses(Callback):
    def __init__(self, sleep=0.0):
        self.losses = []
        self.params_norms = []  # what the logging rank sends to its tracker
        self.sleep = sleep

    def on_train_start(self, state):
        send = state.tracker.log_metrics

        def record(metrics, step):
            if "params-norm" in metrics:
                self.params_norms.append(metrics["params-norm"])
            send(metrics, step)

        state.tracker.log_metrics = record

    def on_step_end(self, state, metrics):
        if "lm loss" in metrics:
            self.losses.append(metrics["lm loss"])
        if self.sleep:
            time.sleep(self.sleep)


def failing_forward_step(iteration, rank):
    def step(state, data_iterator, model):
        if state.train_state.step + 1 == iteration and state.rank == rank:
            raise RuntimeError(f"injected failure at iteration {iteration} on rank {rank}")
        return forward_step(state, data_iterator, model)

    return step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--dist-opt", action="store_true")
    p.add_argument("--save", default=None, help="checkpoint directory to save to")
    p.add_argument("--save-interval", type=int, default=None)
    p.add_argument("--load", default=None, help="checkpoint directory to resume from")
    p.add_argument("--most-recent-k", type=int, default=-1)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--exit-interval", type=int, default=None)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--fail-at", type=int, default=None, help="raise in the forward step of this iteration")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--timeout-minutes", type=int, default=2)
    p.add_argument("--fault-tolerance", action="store_true", help="report to ft_launcher (ft.enable_ft_package)")
    p.add_argument("--simulate-fault", default=None, choices=["rank_killed", "rank_hung", "random"])
    p.add_argument("--fault-rank", type=int, default=0)
    p.add_argument("--fault-delay", type=int, default=3)
    p.add_argument("--exit-signal-handler", action="store_true")
    p.add_argument(
        "--step-sleep", type=float, default=0.0,
        help="seconds to sleep after each step (on the first attempt only: a restarted job runs at full speed)",
    )  # fmt: skip
    p.add_argument("--backend", default="auto", help="dist.distributed_backend (tests: factories.backend_for)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = tiny_config(
        train=TrainingConfig(train_iters=args.iters, global_batch_size=args.gbs, micro_batch_size=args.mbs),
        model=tiny_model(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            hidden_dropout=args.dropout,
            attention_dropout=args.dropout,
        ),
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
    )
    cfg.logger.log_interval = 1
    cfg.logger.log_params_norm = True
    cfg.dist.distributed_timeout_minutes = args.timeout_minutes
    cfg.dist.distributed_backend = args.backend
    if args.dist_opt:
        cfg.ddp.use_distributed_optimizer = True
    cfg.checkpoint.save = args.save
    cfg.checkpoint.save_interval = args.save_interval
    cfg.checkpoint.load = args.load
    cfg.checkpoint.most_recent_k = args.most_recent_k
    cfg.checkpoint.async_save = args.async_save
    cfg.train.exit_signal_handler = args.exit_signal_handler
    cfg.train.exit_interval = args.exit_interval
    if args.fault_tolerance or args.simulate_fault:
        from megatron_bridge.training.config import FaultToleranceConfig

        cfg.ft = FaultToleranceConfig(
            enable_ft_package=args.fault_tolerance,
            calc_ft_timeouts=args.fault_tolerance,
            simulate_fault=args.simulate_fault is not None,
            simulated_fault_type=args.simulate_fault or "random",
            simulated_fault_rank=args.fault_rank,
            simulated_fault_base_delay=args.fault_delay,
        )
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    recorder = RecordLosses(0.0 if restarted else args.step_sleep)
    step = forward_step
    if args.fail_at is not None:
        step = failing_forward_step(args.fail_at, args.fail_rank)
    state = pretrain(cfg, step, callbacks=[recorder])
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{args.out}.rank{rank}", "w") as f:
        launcher = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
        json.dump({"losses": recorder.losses, "params_norms": recorder.params_norms, "step": state.train_state.step,
                   "dp": cfg.data_parallel_size, "launcher": launcher, "logging_rank": state.is_logging_rank}, f)


if __name__ == "__main__":
    main()
