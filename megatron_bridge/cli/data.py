"""`mbridge data preprocess|inspect`: text corpora to megatron indexed datasets, and a look at one."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from megatron_bridge.cli.errors import UsageError
from megatron_bridge.runtime.tokenizers.config import TEXT_TOKENIZER_TYPES

EPILOG = """\
examples:
  mbridge data preprocess --input corpus.jsonl --output-prefix data/corpus --tokenizer tok/ --append-eod
      writes data/corpus_text_document.bin/.idx (use data/corpus_text_document as dataset.data_path)
  mbridge data preprocess --input 'shards/*.parquet' --json-keys title body --output-prefix data/web \\
      --tokenizer tok/ --workers 16 --append-eod
  mbridge data preprocess --input my_dataset/ --split train --output-prefix data/d --tokenizer tok/
  mbridge data preprocess --input corpus.jsonl --output-prefix data/corpus --append-eod \
      --tokenizer-type GPT2BPETokenizer --vocab-file gpt2/vocab.json --merge-file gpt2/merges.txt
  mbridge data inspect data/corpus_text_document --tokenizer tok/"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "data",
        help="preprocess text into indexed datasets (.bin/.idx), inspect them",
        description="Turn text into megatron indexed datasets for dataset.data_path, and inspect them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    pre = sub.add_parser(
        "preprocess",
        help="tokenize JSONL / JSON / Parquet / Arrow / a datasets directory into .bin/.idx",
        description="Tokenize documents into <output-prefix>_<key>_document.bin/.idx (flags as in Megatron-LM's "
        "preprocess_data.py). Workers read and tokenize chunks of the input; the output does not depend on "
        "their number, and nothing is left under the final names if the run is interrupted.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pre.add_argument("--input", required=True, metavar="PATH", help="a .jsonl/.json/.parquet/.arrow file, a glob of them, a directory of them, or a datasets (save_to_disk) directory")
    pre.add_argument("--output-prefix", required=True, metavar="PREFIX", help="output path prefix; key 'text' gives PREFIX_text_document.bin/.idx")
    pre.add_argument("--tokenizer", metavar="DIR", help="local tokenizer: a directory with tokenizer.json (or one transformers.AutoTokenizer loads offline), or the file")
    pre.add_argument("--tokenizer-type", choices=TEXT_TOKENIZER_TYPES, default="HuggingFaceTokenizer", help="HuggingFaceTokenizer (from --tokenizer, the default), GPT2BPETokenizer (from --vocab-file and --merge-file), or SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer (--tokenizer is the .model file)")
    pre.add_argument("--vocab-file", metavar="FILE", help="GPT2BPETokenizer: GPT-2's vocab.json")
    pre.add_argument("--merge-file", metavar="FILE", help="GPT2BPETokenizer: GPT-2's merges.txt")
    pre.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY", help="fields (columns) to tokenize, one output each (default: text)")
    pre.add_argument("--workers", type=int, default=None, metavar="N", help="worker processes (default: the CPU cores available)")
    pre.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's end-of-document token")
    pre.add_argument("--split-sentences", action="store_true", help="store each sentence as its own sequence (outputs *_sentence.bin/.idx)")
    pre.add_argument("--keep-newlines", action="store_true", help="with --split-sentences: keep the whitespace between sentences")
    pre.add_argument("--split", default="train", metavar="NAME", help="split of a datasets directory or data-file directory (default: train)")
    pre.add_argument("--tokenizer-kwargs", default=None, metavar="JSON", help='options for the tokenizer, e.g. \'{"eos_token": "</s>"}\'')
    pre.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    pre.set_defaults(handler=run_preprocess)

    ins = sub.add_parser("inspect", help="counts and decoded samples of an indexed dataset", description="Print documents, sequences, tokens, lengths and a few samples of PREFIX.bin/.idx.")
    ins.add_argument("prefix", metavar="PREFIX", help="the dataset prefix (without .bin/.idx)")
    ins.add_argument("--tokenizer", metavar="DIR", help="decode samples with this tokenizer (else token ids are shown)")
    ins.add_argument("--tokenizer-type", choices=TEXT_TOKENIZER_TYPES, default="HuggingFaceTokenizer", help="as for preprocess")
    ins.add_argument("--vocab-file", metavar="FILE", help="GPT2BPETokenizer: GPT-2's vocab.json")
    ins.add_argument("--merge-file", metavar="FILE", help="GPT2BPETokenizer: GPT-2's merges.txt")
    ins.add_argument("--samples", type=int, default=3, metavar="N", help="documents to show (default: 3)")
    ins.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens shown per document (default: 64)")
    ins.set_defaults(handler=run_inspect)


def run_preprocess(args: argparse.Namespace) -> int:
    from megatron_bridge.data.preprocess import PreprocessError, PreprocessOptions, preprocess

    try:
        kwargs = json.loads(args.tokenizer_kwargs) if args.tokenizer_kwargs else {}
    except json.JSONDecodeError as exc:
        raise UsageError(f"--tokenizer-kwargs is not JSON: {exc}") from None
    workers = args.workers if args.workers is not None else len(os.sched_getaffinity(0))
    options = PreprocessOptions(
        input=args.input,
        output_prefix=args.output_prefix,
        tokenizer=args.tokenizer,
        json_keys=args.json_keys,
        workers=workers,
        append_eod=args.append_eod,
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        split=args.split,
        tokenizer_kwargs=kwargs,
        progress=not args.no_progress,
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
    )
    try:
        results = preprocess(options)
    except PreprocessError as exc:
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt:
        print("interrupted: nothing was written under the output names")
        return 130
    for key, r in results.items():
        skipped = f", {r.skipped_empty:,} empty skipped" if r.skipped_empty else ""
        print(f"{key}: {r.prefix}.bin/.idx: {r.documents:,} documents, {r.tokens:,} tokens{skipped}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    import numpy as np

    from megatron_bridge.data.indexed import check_index_arrays, largest_token_id, read_index_header

    prefix = args.prefix[: -len(".bin")] if args.prefix.endswith((".bin", ".idx")) else args.prefix
    for suffix in (".bin", ".idx"):
        if not os.path.isfile(prefix + suffix):
            raise UsageError(f"no {prefix + suffix}")
    try:
        header = read_index_header(prefix)
        check_index_arrays(prefix, header)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    actual = os.path.getsize(prefix + ".bin")
    lengths, doc_index = _read_index_arrays(prefix, header)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    per_doc = offsets[doc_index[1:]] - offsets[doc_index[:-1]]
    print(f"{prefix}")
    print(f"  dtype:     {np.dtype(header.dtype).name}")
    print(f"  documents: {header.documents:,}")
    print(f"  sequences: {header.sequences:,}")
    print(f"  tokens:    {header.tokens:,}")
    if per_doc.size:
        print(f"  tokens per document: min {per_doc.min():,}, mean {per_doc.mean():,.1f}, max {per_doc.max():,}")
    print(f"  largest token id (sampled): {largest_token_id(prefix, header.dtype)}")
    if actual != header.bin_bytes:
        print(f"  WARNING: the .bin has {actual:,} bytes, the .idx describes {header.bin_bytes:,}")
    tokenizer = None
    if args.tokenizer or args.vocab_file or args.merge_file:
        from megatron_bridge.data.preprocess import PreprocessError, tokenizer_from_flags

        try:
            tokenizer = tokenizer_from_flags(args.tokenizer_type, args.tokenizer, args.vocab_file, args.merge_file)
        except PreprocessError as exc:
            raise UsageError(str(exc)) from None
    if actual < np.dtype(header.dtype).itemsize:  # no tokens to show (and numpy maps no empty file)
        return 0
    data = np.memmap(prefix + ".bin", dtype=header.dtype, mode="r")
    for d in range(min(args.samples, header.documents)):
        begin, end = offsets[doc_index[d]], offsets[doc_index[d + 1]]
        ids = np.asarray(data[begin : min(end, begin + args.max_tokens)]).tolist()
        more = " ..." if end - begin > args.max_tokens else ""
        shown = repr(tokenizer.detokenize(ids, skip_special_tokens=False)) if tokenizer is not None else " ".join(map(str, ids))
        print(f"  document {d} ({end - begin} tokens): {shown}{more}")
    return 0


def _read_index_arrays(prefix: str, header: Any) -> tuple[Any, Any]:
    import numpy as np

    with open(prefix + ".idx", "rb") as f:
        f.seek(34)
        lengths = np.fromfile(f, dtype=np.int32, count=header.sequences)
        f.seek(34 + 12 * header.sequences)
        doc_index = np.fromfile(f, dtype=np.int64, count=header.documents + 1)
    return lengths, doc_index
