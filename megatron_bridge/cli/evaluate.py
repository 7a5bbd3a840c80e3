"""`mbridge eval SOURCE --data FILE`: loss and perplexity on a corpus, multiple-choice accuracy."""

from __future__ import annotations

import argparse
import json
from typing import Any

from megatron_bridge.cli.model_source import add_source_arguments, load_options, prints, user_errors

EPILOG = """\
examples:
  mbridge eval /models/Meta-Llama-3-8B --data held_out.jsonl              {"text": ...} per line
  mbridge eval runs/pretrain/checkpoints --data data/valid_text_document --concat --seq-length 2048
  mbridge eval runs/sft/checkpoints --data sft/validation.jsonl           loss where fine-tuning trains
  mbridge eval runs/lora/checkpoints --data choices.jsonl --json          {"context", "choices", "label"}

The format is detected: JSONL text (the --text-key field), an indexed dataset (PREFIX, PREFIX.bin or
PREFIX.idx), fine-tuning JSONL ({"input", "output"} or {"messages"}; the loss covers the answer or the
assistant turns), or multiple choice ({"context", "choices": [...], "label": index}), scored by the
log-likelihood of each choice after the context: accuracy picks the highest sum (the harnesses' acc), and
the length-normalized accuracy divides by the choice's length in characters (their acc_norm).
Text lines are scored one by one with the tokenizer's default encoding, truncated to --seq-length tokens;
--concat joins documents (each ending with the end-of-document token) into pretraining windows.
--json prints {"loss", "perplexity", "tokens"} (and "accuracy" for multiple choice) as the last line."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "eval",
        help="loss and perplexity on a corpus, or multiple-choice accuracy, of a Hugging Face model or a checkpoint",
        description="Score a model on a data file: the loss is the mean next-token negative log-likelihood (nats) "
        "over every counted token, the perplexity its exponential.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_source_arguments(p, batch_size=8)
    p.add_argument("--data", required=True, metavar="FILE", help="JSONL file, or the prefix of PREFIX.bin/PREFIX.idx")
    p.add_argument("--text-key", default="text", metavar="KEY", help="field of a text line that holds its text (default: %(default)s)")
    p.add_argument("--seq-length", type=int, metavar="N", help="longest sequence scored (default: the model's)")
    p.add_argument("--concat", action="store_true", help="join documents into windows of --seq-length tokens, as pretraining does")
    p.add_argument("--format", dest="data_format", choices=["text", "indexed", "sft", "choice"], help="the data's format (default: detected)")
    p.set_defaults(handler=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    with user_errors():
        from megatron_bridge.inference.evaluation import evaluate

        result = evaluate(
            args.source, args.data, text_key=args.text_key, seq_length=args.seq_length, concat=args.concat,
            data_format=args.data_format, batch_size=args.batch_size, **load_options(args),
        )  # fmt: skip
    if not prints():
        return 0
    what = "items" if result.accuracy is not None else "sequences"
    print(f"{args.source} on {args.data}: {result.format} data, {result.sequences} {what}")
    print(f"loss {result.loss:.6f}  perplexity {result.perplexity:.4f}  tokens {result.tokens}")
    if result.accuracy is not None:
        print(f"accuracy {result.accuracy:.4f}  length-normalized accuracy {result.accuracy_norm:.4f}")
    if args.json:
        print(json.dumps(result.to_json()))
    return 0
