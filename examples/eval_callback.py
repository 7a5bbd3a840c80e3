"""A callback that evaluates a held-out set during training with `megatron_bridge.inference`:
every `--every` iterations it scores the model on a JSONL file (the loss and perplexity that
`mbridge eval` reports for a checkpoint of that iteration) and keeps the history.

    python examples/eval_callback.py --dir runs --train-iters 40 --every 10 [--held-out FILE.jsonl]

The tiny recipe trains on mock data (counting sequences of token ids, NullTokenizer); without
`--held-out`, a file of such sequences is written next to the run. Any format `evaluate()` reads
works (text, fine-tuning rows, multiple choice, an indexed dataset). The model must be whole in
each process (pipeline-parallel size 1); under tensor parallelism every rank takes part.
"""

from __future__ import annotations

import argparse
import json
import os

from megatron_bridge.inference import InferenceModel, evaluate
from megatron_bridge.training.callbacks import Callback
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain
from recipes import tiny_gpt_pretrain_config


class HeldOutEvaluation(Callback):
    """Scores the model on `data` every `every` iterations and after the last one."""

    def __init__(self, data: str, every: int, **options):
        self.data, self.every, self.options = data, every, options
        self.history: list[dict] = []

    def on_step_end(self, state, metrics):
        if state.train_state.step % self.every == 0:
            self.evaluate(state)

    def on_train_end(self, state):
        if not self.history or self.history[-1]["iteration"] != state.train_state.step:
            self.evaluate(state)

    def evaluate(self, state):
        model = InferenceModel.from_module(state.model[0], state.tokenizer)
        result = evaluate(model, self.data, **self.options)  # eval mode and no gradients inside
        self.history.append({"iteration": state.train_state.step, "loss": result.loss, "perplexity": result.perplexity,
                             "tokens": result.tokens})  # fmt: skip
        if state.is_logging_rank:
            print(f"held-out loss {result.loss:.6f} (perplexity {result.perplexity:.3f}, {result.tokens} tokens) "
                  f"at iteration {state.train_state.step}", flush=True)  # fmt: skip


def write_counting_sequences(path: str, count: int = 16, length: int = 40, vocab: int = 255) -> None:
    """Held-out lines like the mock data: token ids counting up from a different start."""
    with open(path, "w") as f:
        for i in range(count):
            start = 7 * i + 3
            f.write(json.dumps({"text": " ".join(str((start + k) % vocab) for k in range(length))}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="runs", help="where checkpoints and logs go")
    parser.add_argument("--train-iters", type=int, default=100)
    parser.add_argument("--every", type=int, default=25, help="evaluate every N iterations")
    parser.add_argument("--held-out", help="JSONL file to evaluate on (default: counting sequences written to the run directory)")
    args = parser.parse_args()

    run_dir = os.path.join(args.dir, "example_eval_callback")
    os.makedirs(run_dir, exist_ok=True)
    data = args.held_out or os.path.join(run_dir, "held_out.jsonl")
    if not args.held_out:
        write_counting_sequences(data)
    cfg = tiny_gpt_pretrain_config(dir=args.dir, name="example_eval_callback", train_iters=args.train_iters)
    held_out = HeldOutEvaluation(data, args.every)
    pretrain(cfg, forward_step, callbacks=[held_out])
    with open(os.path.join(run_dir, "held_out_history.json"), "w") as f:
        json.dump(held_out.history, f)


if __name__ == "__main__":  # the checkpoint writer re-imports this file in its helper processes
    main()
