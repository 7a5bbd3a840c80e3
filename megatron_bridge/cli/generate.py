"""`mbridge generate SOURCE`: text from a model, greedy or sampled."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from megatron_bridge.cli.model_source import add_source_arguments, load_options, prints, user_errors
from megatron_bridge.cli.errors import UsageError

EPILOG = """\
examples:
  mbridge generate /models/Meta-Llama-3-8B --prompt "The capital of France is" --max-new-tokens 20
  mbridge generate runs/sft/checkpoints --chat --prompt "Hi!" --temperature 0.7 --top-p 0.9 --seed 1
  mbridge generate runs/lora/checkpoints --prompts prompts.jsonl --json > answers.jsonl
  torchrun --nproc_per_node=2 -m megatron_bridge generate /models/Meta-Llama-3-8B --prompt "Hello"

A prompts file has one JSON value per line: {"prompt": "..."}, {"messages": [{"role": ..., "content": ...}]}
(rendered with the chat template), or a string. --json prints one object per prompt, in order:
{"prompt", "text", "token_ids" (the new tokens), "finish_reason" (eos, stop or length)}; the speed then
goes to stderr."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a Hugging Face model or a checkpoint (greedy or sampled, batched, KV cache)",
        description="Generate text for each prompt: greedy by default, or sampled (--temperature, --top-k, "
        "--top-p, --seed). A generation ends at the end-of-sequence token (and the end-of-turn tokens of the "
        "model's generation_config.json), at a --stop string, or after --max-new-tokens. Prints the "
        "generations and the speed in new tokens per second.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_source_arguments(p, batch_size=16)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeat for several)")
    p.add_argument("--prompts", metavar="FILE.jsonl", help="prompts, one per line (after any --prompt)")
    p.add_argument("--chat", action="store_true", help="render each prompt as a user message with the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="most new tokens per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, metavar="T", help="sample at this temperature (0: greedy; default: greedy, "
                   "or 1.0 with --top-k/--top-p)")  # fmt: skip
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely tokens (default: all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="sample among the most likely tokens holding probability P (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the samples (default: %(default)s)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="end a generation where this text appears (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    with user_errors():
        from megatron_bridge.inference.prompts import read_prompts

        prompts = list(args.prompt) + (read_prompts(args.prompts) if args.prompts else [])
        if not prompts:
            raise UsageError("give a prompt: --prompt TEXT (repeatable) or --prompts FILE.jsonl")
        from megatron_bridge.inference.generation import generate

        results = generate(
            args.source, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat,
            ignore_eos=args.ignore_eos, batch_size=args.batch_size, **load_options(args),
        )  # fmt: skip
    if not prints():
        return 0
    speed = (f"{results.new_tokens} new tokens for {len(results)} prompt{'s' if len(results) != 1 else ''} in "
             f"{results.seconds:.2f} s: {results.tokens_per_second:.1f} tokens/s")  # fmt: skip
    if args.json:
        for g in results:
            print(json.dumps(g.to_json(), ensure_ascii=False))
        print(speed, file=sys.stderr)
        return 0
    for i, g in enumerate(results, 1):
        shown = g.prompt if isinstance(g.prompt, str) else json.dumps(g.prompt, ensure_ascii=False)
        print(f"=== prompt {i} ({len(g.token_ids)} new tokens, {g.finish_reason})")
        print(shown)
        print("--- generated")
        print(g.text)
    print(speed)
    return 0
