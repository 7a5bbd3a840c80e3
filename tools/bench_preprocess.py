"""Corpus preprocessing vs the tokenizer's own `encode_batch`, side by side in one run.

1. Generates JSONL text (default about 200 MB, also cut into 8 shards, and its first quarter as a
   50 MB file) and trains a byte-level BPE tokenizer (8,000 tokens) on a sample of it (or uses
   --tokenizer DIR).
2. Speed, shard by shard in alternating order (A B B A ...), so both see the same machine load:
   - baseline: `Tokenizer.encode_batch` over the shard's texts, already in memory, in batches of
     1,000 documents, with the tokenizer's own threads on every core (only the calls are timed);
   - preprocessing: `preprocess()` of the shard's JSONL file with one worker per core, timed from
     start to end (starting the workers, reading, parsing, tokenizing, writing .bin/.idx).
   tokens/s of each = the shards' text tokens / their summed seconds.
3. Memory: `mbridge data preprocess` on the 50 MB and the 200 MB file (a subprocess each), with
   the RSS of its whole process tree (main process + workers) sampled every 20 ms.

    python tools/bench_preprocess.py [--mb 200] [--shards 8] [--tokenizer DIR] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they which one you were her all "
    "she there would their we him been has when who will more no if out so said what up its about into than them can only "
    "other new some could time these two may then do first any my now such like our over man me even most made after also "
    "did many before must through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right used take three river garden "
    "station morning quietly painted carried remembered wooden harbour lantern mountain village library engine"
).split()


def make_corpus(path: str, megabytes: int, seed: int = 0) -> int:
    """JSONL of documents of 1 to 30 sentences of Zipf-distributed words; returns documents."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(WORDS))]
    target = megabytes * 2**20
    written = docs = 0
    with open(path, "w") as f:
        while written < target:
            sentences = []
            for _ in range(rng.randint(1, 30)):
                words = rng.choices(WORDS, weights, k=rng.randint(5, 25))
                if rng.random() < 0.2:
                    words.append(str(rng.randint(1, 3000)))
                sentences.append(" ".join(words).capitalize() + rng.choice(".!?."))
            line = json.dumps({"id": docs, "text": " ".join(sentences)}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def head_file(src: str, dst: str, megabytes: int) -> None:
    target = megabytes * 2**20
    with open(src) as fin, open(dst, "w") as fout:
        written = 0
        for line in fin:
            if written >= target:
                break
            fout.write(line)
            written += len(line)


def train_tokenizer(directory: str, corpus: str, vocab_size: int = 8000) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(directory, exist_ok=True)
    sample = []
    with open(corpus) as f:
        for i, line in enumerate(f):
            if i >= 5000:
                break
            sample.append(json.loads(line)["text"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample, trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    return directory


def baseline(texts: list[str], tokenizer_dir: str) -> tuple[float, int]:
    """(seconds in encode_batch, tokens) over `texts`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    seconds, tokens = 0.0, 0
    for start in range(0, len(texts), 1000):
        batch = texts[start : start + 1000]
        t0 = time.perf_counter()
        encodings = tok.encode_batch(batch, add_special_tokens=False)
        seconds += time.perf_counter() - t0
        tokens += sum(len(e.ids) for e in encodings)
    return seconds, tokens


def preprocess_in_process(corpus: str, tokenizer_dir: str, prefix: str, workers: int) -> tuple[float, int, int]:
    """(seconds, tokens written, documents) of `preprocess()` on `corpus`."""
    from megatron_bridge.data.preprocess import PreprocessOptions, preprocess

    t0 = time.perf_counter()
    result = preprocess(PreprocessOptions(input=corpus, output_prefix=prefix, tokenizer=tokenizer_dir, workers=workers, append_eod=True, progress=False))
    seconds = time.perf_counter() - t0
    return seconds, result["text"].tokens, result["text"].documents


def shard(corpus: str, directory: str, count: int) -> list[str]:
    """`corpus` cut into `count` JSONL files of about the same size."""
    size = os.path.getsize(corpus)
    paths = [os.path.join(directory, f"shard_{i}.jsonl") for i in range(count)]
    with open(corpus) as f:
        out, i, written = open(paths[0], "w"), 0, 0
        for line in f:
            if written >= size * (i + 1) / count and i + 1 < count:
                out.close()
                i += 1
                out = open(paths[i], "w")
            out.write(line)
            written += len(line)
        out.close()
    return paths


def tree_rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_preprocess(corpus: str, tokenizer_dir: str, prefix: str, workers: int) -> tuple[float, int, int]:
    """(wall seconds, tokens, peak RSS of the process tree in bytes)."""
    cmd = [sys.executable, "-m", "megatron_bridge", "data", "preprocess", "--input", corpus, "--output-prefix", prefix,
           "--tokenizer", tokenizer_dir, "--workers", str(workers), "--append-eod", "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    seconds = time.perf_counter() - t0
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"preprocess failed ({proc.returncode}):\n{err}")
    tokens = int(re.search(r"([\d,]+) tokens", out).group(1).replace(",", ""))
    return seconds, tokens, peak[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=200, help="size of the large input in MB (the small one is a quarter)")
    parser.add_argument("--shards", type=int, default=8, help="shards of the large input for the alternating speed comparison")
    parser.add_argument("--tokenizer", help="a tokenizer directory (default: BPE with 8,000 tokens trained on the corpus)")
    parser.add_argument("--keep", help="directory for the corpus and outputs (kept); default: a temporary one")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    cores = len(os.sched_getaffinity(0))
    work = args.keep or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(work, exist_ok=True)
    large, small = os.path.join(work, f"corpus_{args.mb}mb.jsonl"), os.path.join(work, f"corpus_{args.mb // 4}mb.jsonl")
    try:
        if not os.path.exists(large):
            t0 = time.perf_counter()
            docs = make_corpus(large, args.mb)
            print(f"generated {large}: {docs:,} documents in {time.perf_counter() - t0:.0f} s")
        if not os.path.exists(small):
            head_file(large, small, args.mb // 4)
        shard_dir = os.path.join(work, "shards")
        os.makedirs(shard_dir, exist_ok=True)
        shards = shard(large, shard_dir, args.shards)
        tok = args.tokenizer or train_tokenizer(os.path.join(work, "tokenizer"), large)
        size_large, size_small = os.path.getsize(large), os.path.getsize(small)
        print(f"cores: {cores} | input: {size_large / 2**20:.0f} MB of JSONL in {len(shards)} shards; {size_small / 2**20:.0f} MB | tokenizer: {tok}")

        base_s = pre_s = 0.0
        text_tokens = 0
        for i, path in enumerate(shards):
            with open(path) as f:
                texts = [json.loads(line)["text"] for line in f]
            order = ("base", "pre") if i % 4 in (0, 3) else ("pre", "base")  # A B B A: cancels a drift in load
            times = {}
            for what in order:
                if what == "base":
                    times["base"], tokens = baseline(texts, tok)
                else:
                    times["pre"], written, documents = preprocess_in_process(path, tok, os.path.join(work, "out_shard"), cores)
            if written != tokens + documents:  # preprocessing adds one EOD per document
                raise SystemExit(f"shard {i}: token counts differ: encode_batch {tokens:,}, preprocess {written:,} for {documents:,} documents")
            base_s += times["base"]
            pre_s += times["pre"]
            text_tokens += tokens
            print(f"  shard {i}: {tokens:,} tokens | encode_batch {times['base']:.1f} s | preprocess {times['pre']:.1f} s", flush=True)
        base_rate, pre_rate = text_tokens / base_s, text_tokens / pre_s

        rss = {}
        for name, path in (("small", small), ("large", large)):
            seconds, tokens, peak = run_preprocess(path, tok, os.path.join(work, f"out_{name}"), cores)
            rss[name] = peak
            print(f"  mbridge data preprocess {os.path.getsize(path) / 2**20:.0f} MB: {tokens:,} tokens in {seconds:.1f} s, peak RSS {peak / 2**20:.0f} MB", flush=True)
        print()
        print(f"tokens/s, {cores} cores, {size_large / 2**20:.0f} MB of JSONL: preprocess {pre_rate:,.0f} ({pre_s:.1f} s) vs encode_batch {base_rate:,.0f} ({base_s:.1f} s) = {pre_rate / base_rate:.2f}x (goal >= 0.7x)")
        print(f"peak RSS of preprocess (main + {cores} workers): {rss['small'] / 2**20:.0f} MB at {size_small / 2**20:.0f} MB of input, "
              f"{rss['large'] / 2**20:.0f} MB at {size_large / 2**20:.0f} MB = {rss['large'] / rss['small']:.2f}x (goal: flat, ~1.0x)")  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
