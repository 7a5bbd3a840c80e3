"""Cost of a new token against the length of the prefix, with the KV cache of `generate()` and
without one, side by side in one process on the CPU.

    python tools/bench_generate.py [--short 16] [--long 512] [--new 32] [--rounds 5] [--layers 2] [--hidden 64]

Builds a randomly initialized GPT (megatron-core local layers, RoPE) and, alternating `--rounds`
times between a `--short` and a `--long` prompt, decodes `--new` tokens greedily: with the cache
(`kv_cache.CachedDecoder`, what `generate()` runs: one position per step) and without (the whole
sequence again for every token). Prints the median time per new token at each prefix length and
the ratio long/short; the goal for the cache is <= 1.5x. Then `generate()` end to end at both
lengths (tokens/s, prefill included).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", type=int, default=16, help="tokens of the short prompt")
    p.add_argument("--long", type=int, default=512, help="tokens of the long prompt")
    p.add_argument("--new", type=int, default=32, help="new tokens per measurement")
    p.add_argument("--rounds", type=int, default=7, help="alternations of short and long")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    args = p.parse_args()

    import torch

    from megatron_bridge.inference import generate
    from megatron_bridge.inference.kv_cache import CachedDecoder, left_pad
    from megatron_bridge.inference.model import InferenceModel
    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.models.hf.runtime import build_chunks, model_parallel, prepare
    from megatron_bridge.runtime.tokenizers.tokenizer import NullTokenizer

    seq_length = args.long + args.new + 8
    provider = GPTModelProvider(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                                seq_length=seq_length, vocab_size=args.vocab, position_embedding_type="rope",
                                hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    with model_parallel() as device:
        built = prepare(provider, device, initialize=True, parallel_output=False)
        (module,) = build_chunks(built, device)
        model = InferenceModel(module, NullTokenizer(args.vocab), vocab_size=args.vocab, seq_length=seq_length)
        rng = torch.Generator().manual_seed(0)
        prompts = {n: torch.randint(0, args.vocab, (n,), generator=rng).tolist() for n in (args.short, args.long)}

        def per_token(run) -> tuple[float, float]:
            """(wall seconds, CPU seconds of this process) per new token of `run`."""
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            return (time.perf_counter() - wall) / args.new, (time.process_time() - cpu) / args.new

        def cached(prompt: list[int]) -> tuple[float, float]:
            tokens, real = left_pad([prompt], 0, model.device)
            decoder = CachedDecoder(model, 1, len(prompt) + args.new + 1)
            state = {"next": decoder.prefill(tokens, real).argmax(-1)}

            def steps() -> None:
                for _ in range(args.new):
                    state["next"] = decoder.step(state["next"]).argmax(-1)

            return per_token(steps)

        def recomputed(prompt: list[int]) -> tuple[float, float]:
            def steps() -> None:
                ids = torch.tensor([prompt], device=model.device)
                for _ in range(args.new):
                    positions = torch.arange(ids.shape[1], device=model.device)[None]
                    nxt = model.logits(ids, positions, None)[:, -1].argmax(-1)
                    ids = torch.cat([ids, nxt[:, None]], dim=1)

            return per_token(steps)

        times: dict[tuple[str, int], list[tuple[float, float]]] = {}
        with model.evaluating():
            for n in prompts:  # warm-up
                cached(prompts[n])
                recomputed(prompts[n])
            for _ in range(args.rounds):
                for n in (args.short, args.long):
                    times.setdefault(("cache", n), []).append(cached(prompts[n]))
                    times.setdefault(("none", n), []).append(recomputed(prompts[n]))
        print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocabulary {args.vocab}; "
              f"{torch.get_num_threads()} threads; {args.rounds} rounds of {args.new} new tokens")  # fmt: skip
        stats = (("wall, best", 0, min), ("wall, median", 0, statistics.median), ("CPU, median", 1, statistics.median))
        for kind, label in (("cache", "KV cache (generate)"), ("none", "no cache (recompute)")):
            for stat, clock, pick in stats:
                short, long = (pick([t[clock] for t in times[(kind, n)]]) for n in (args.short, args.long))
                print(f"{label} {stat:12s} per new token: {short * 1e3:7.2f} ms at a {args.short}-token prefix, "
                      f"{long * 1e3:7.2f} ms at {args.long}: ratio {long / short:.2f}")  # fmt: skip
        for n in (args.short, args.long):
            out = generate(model, [" ".join(map(str, prompts[n]))], max_new_tokens=args.new, ignore_eos=True)
            print(f"generate(), {n}-token prompt: {out.new_tokens} new tokens in {out.seconds:.3f} s, "
                  f"{out.tokens_per_second:.1f} tokens/s (prefill included)")  # fmt: skip


if __name__ == "__main__":
    main()
