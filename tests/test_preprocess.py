"""`mbridge data preprocess|inspect`: JSONL / Parquet / datasets directories to .bin/.idx that
megatron-core reads, independent of the worker count, and a pretraining run on the result."""

import filecmp
import json
import os
from statistics import mean

import numpy as np
import pytest
from text_data import documents, train_tokenizer, write_jsonl

from megatron_bridge.cli.main import main
from megatron_bridge.data import preprocess as pre
from megatron_bridge.data.indexed import IndexedDatasetWriter, read_index_header
from megatron_bridge.runtime.tokenizers.tokenizer import HuggingFaceTokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=256)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    write_jsonl(path, [{"id": i, "text": d} for i, d in enumerate(documents(5000, seed=1))])
    return path


def options(tok_dir, input, prefix, **kw):
    return pre.PreprocessOptions(input=str(input), output_prefix=str(prefix), tokenizer=tok_dir, progress=False, **kw)


def same_files(a, b):
    return all(filecmp.cmp(f"{a}{s}", f"{b}{s}", shallow=False) for s in (".bin", ".idx"))


@pytest.mark.timeout(300)
def test_preprocess_5000_documents_then_pretrain_with_data_paths(tok_dir, corpus, tmp_path, monkeypatch, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_bridge.training.callbacks import Callback
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain
    from recipes import tiny_gpt_pretrain_config

    monkeypatch.setattr(pre, "CHUNK_BYTES", 64 << 10)  # ~15 chunks: the workers really share the file
    for workers in (1, 2):
        code = main(["data", "preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / f"w{workers}"), "--tokenizer", tok_dir, "--workers", str(workers), "--append-eod", "--no-progress"])
        assert code == 0
    out = capsys.readouterr().out
    assert f"text: {tmp_path}/w2_text_document.bin/.idx: 5,000 documents" in out
    prefix = str(tmp_path / "w1_text_document")
    assert same_files(prefix, tmp_path / "w2_text_document")  # bit-identical with 1 and 2 workers

    tok = HuggingFaceTokenizer(tok_dir)
    ds = IndexedDataset(prefix)
    first = json.loads(corpus.read_text().splitlines()[0])["text"]
    assert len(ds) == 5000 and ds[0].tolist() == tok.tokenize(first) + [tok.eod]

    losses = []

    class Record(Callback):
        def on_step_end(self, state, metrics):
            losses.append(metrics["lm loss"])

    cfg = tiny_gpt_pretrain_config(
        dir=str(tmp_path / "runs"), data_paths=[prefix], tokenizer=tok_dir, train_iters=40, seq_length=64,
        lr_warmup_iters=4, eval_interval=1000, eval_iters=1, save_interval=None,
    )  # fmt: skip
    cfg.model.vocab_size = 320  # the tiny model's 256 does not hold this tokenizer's 260 tokens
    cfg.checkpoint.save = None
    cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = None
    state = pretrain(cfg, forward_step, callbacks=[Record()])
    assert state.train_state.step == 40
    print("losses", [round(x, 2) for x in losses])
    assert mean(losses[-5:]) < mean(losses[:5]) - 1.0


def test_writer_matches_megatron_core_builder_byte_for_byte(tmp_path):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 60000, rng.integers(1, 40)).tolist() for _ in range(rng.integers(1, 4))] for _ in range(300)]
    ref = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    ours = IndexedDatasetWriter(str(tmp_path / "ours"), np.uint16)
    for sentences in docs:
        flat = [t for s in sentences for t in s]
        ref.add_document(torch.tensor(flat), [len(s) for s in sentences])
    half = len(docs) // 2  # in two bulk appends, as the workers deliver them
    for part in (docs[:half], docs[half:]):
        ours.add_documents(
            np.array([t for d in part for s in d for t in s]), np.array([len(s) for d in part for s in d]), np.array([len(d) for d in part])
        )
    ref.finalize(str(tmp_path / "ref.idx"))
    assert not os.path.exists(tmp_path / "ours.bin")  # under a temporary name until finalized
    ours.finalize()
    assert same_files(tmp_path / "ref", tmp_path / "ours")
    read = IndexedDataset(str(tmp_path / "ours"))
    assert read[0].tolist() == docs[0][0] and read[len(docs[0])].tolist() == docs[1][0]  # one item per sentence
    header = read_index_header(str(tmp_path / "ours"))
    assert (header.documents, header.sequences) == (300, sum(len(d) for d in docs))


def test_sentences_keys_and_other_input_formats_give_the_same_output(tok_dir, tmp_path):
    rows = [{"title": f"Story {i}.", "text": d} for i, d in enumerate(documents(200, seed=2))]
    rows[7]["text"] = ""  # an empty document leaves no sequence
    write_jsonl(tmp_path / "in.jsonl", rows)
    results = pre.preprocess(options(tok_dir, tmp_path / "in.jsonl", tmp_path / "j", json_keys=["title", "text"], split_sentences=True, append_eod=True))
    assert set(results) == {"title", "text"} and results["text"].skipped_empty == 1
    text = results["text"]
    assert text.prefix == str(tmp_path / "j_text_sentence") and text.documents == 199
    header = read_index_header(text.prefix)
    sentences = sum(len(pre.split_sentences(r["text"])) for r in rows)
    assert header.sequences == sentences  # one sequence per sentence
    tok = HuggingFaceTokenizer(tok_dir)
    with open(text.prefix + ".idx", "rb") as f:
        f.seek(34)
        lengths = np.fromfile(f, dtype=np.int32, count=header.sequences)
    data = np.fromfile(text.prefix + ".bin", dtype=np.uint16)
    first = pre.split_sentences(rows[0]["text"])
    assert data[: lengths[0]].tolist() == tok.tokenize(first[0])
    assert data[lengths[: len(first)].sum() - 1] == tok.eod  # the document's last sentence ends with EOD

    # the same rows as Parquet and as a `datasets` directory (the JSONL checks above run without it)
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "in.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for name, source in (("p", tmp_path / "in.parquet"), ("d", tmp_path / "saved")):
        pre.preprocess(options(tok_dir, source, tmp_path / name, json_keys=["title", "text"], split_sentences=True, append_eod=True))
        for key in ("title", "text"):
            assert same_files(tmp_path / f"j_{key}_sentence", tmp_path / f"{name}_{key}_sentence"), (name, key)


def test_sentence_splitting():
    text = 'He left. "Why?" she asked! It rained... Then 3.5 cm fell.\nEnd'
    assert pre.split_sentences(text) == ["He left.", '"Why?"', "she asked!", "It rained...", "Then 3.5 cm fell.", "End"]
    assert "".join(pre.split_sentences(text, keep_newlines=True)) == text


def test_a_bad_line_is_named_and_nothing_is_written(tok_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(pre, "CHUNK_BYTES", 4096)
    lines = [json.dumps({"text": d}) for d in documents(300, seed=3)]
    lines[211] = '{"text": "unterminated'
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(pre.PreprocessError, match=r"bad.jsonl line 212: not valid JSON \(Unterminated string"):
        pre.preprocess(options(tok_dir, tmp_path / "bad.jsonl", tmp_path / "out", workers=2))
    lines[211] = json.dumps({"body": "x"})
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(pre.PreprocessError, match=r"bad.jsonl line 212: no 'text' field \(its fields: \['body'\]; choose with --json-keys\)"):
        pre.preprocess(options(tok_dir, tmp_path / "bad.jsonl", tmp_path / "out", workers=2))
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # no partial output, no temporary files


def test_a_line_that_is_not_utf8_is_named(tok_dir, tmp_path):
    """Latin-1 text in a JSONL file: a malformed line, named (it was a UnicodeDecodeError traceback)."""
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(pre.PreprocessError, match=r"latin1.jsonl line 2: not valid JSON \(not UTF-8 text \(byte 0xe9\), column 14\)"):
        pre.preprocess(options(tok_dir, tmp_path / "latin1.jsonl", tmp_path / "out", workers=1))
    assert os.listdir(tmp_path) == ["latin1.jsonl"]


def test_interruption_leaves_nothing_under_the_final_names(tok_dir, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(pre, "CHUNK_BYTES", 64 << 10)
    calls = []
    original = IndexedDatasetWriter.add_documents

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(IndexedDatasetWriter, "add_documents", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pre.preprocess(options(tok_dir, corpus, tmp_path / "out", workers=2))
    assert os.listdir(tmp_path) == []


def test_cli_errors_and_inspect(tok_dir, corpus, tmp_path, capsys):
    assert main(["data", "preprocess", "--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "o"), "--tokenizer", tok_dir]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["data", "preprocess", "--input", "someorg/somedata", "--output-prefix", str(tmp_path / "o"), "--tokenizer", tok_dir]) == 2
    assert "is not a local path; datasets are read from local files only, and a Hub id is not downloaded" in capsys.readouterr().err
    small = tmp_path / "small.jsonl"
    write_jsonl(small, [{"text": "The cat sees the map."}, {"text": "A dog likes an apple."}])
    assert main(["data", "preprocess", "--input", str(small), "--output-prefix", str(tmp_path / "s"), "--tokenizer", tok_dir, "--append-eod", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "s_text_document"), "--tokenizer", tok_dir]) == 0
    out = capsys.readouterr().out
    assert "documents: 2" in out and "dtype:     uint16" in out
    assert "document 1 (" in out and "'A dog likes an apple.<|endoftext|>'" in out


@pytest.mark.timeout(120)
def test_the_readme_command_creates_the_output_directory(tok_dir, tmp_path):
    """`--output-prefix data/corpus` as the README writes it, in a directory without `data/`: made
    once the input and tokenizer are good; a prefix under a file is refused (exit status 2)."""
    import subprocess
    import sys

    from factories import source_tree_env

    write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in documents(20)])
    (tmp_path / "a_file").write_text("")

    def mbridge(prefix):
        argv = ["data", "preprocess", "--input", "corpus.jsonl", "--output-prefix", prefix, "--tokenizer", tok_dir, "--no-progress"]
        return subprocess.run([sys.executable, "-m", "megatron_bridge", *argv], cwd=tmp_path, env=source_tree_env(),
                              capture_output=True, text=True, timeout=100)  # fmt: skip

    made = mbridge("data/corpus")
    assert made.returncode == 0, made.stderr
    assert "text: data/corpus_text_document.bin/.idx: 20 documents" in made.stdout
    assert (tmp_path / "data" / "corpus_text_document.idx").is_file()
    refused = mbridge("a_file/corpus")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert f"--output-prefix: {str(tmp_path / 'a_file')!r} is not a directory (choose a prefix in a directory)" in refused.stderr


def test_a_prefix_too_long_and_a_full_disk_are_reported_and_leave_nothing(tok_dir, tmp_path):
    """A prefix whose file names (plus their temporary suffix) do not fit the filesystem, and a
    write that fails for lack of space (a file size limit stands in for a full disk): exit status
    2 with the reason, and no partial files left under the output names."""
    import resource
    import subprocess
    import sys

    from factories import source_tree_env

    write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in documents(2000)])
    (tmp_path / "out").mkdir()

    def mbridge(prefix, max_file_bytes=None):
        argv = ["data", "preprocess", "--input", "corpus.jsonl", "--output-prefix", prefix, "--tokenizer", tok_dir, "--no-progress"]
        limit = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))) if max_file_bytes else None
        return subprocess.run([sys.executable, "-m", "megatron_bridge", *argv], cwd=tmp_path, env=source_tree_env(),
                              capture_output=True, text=True, timeout=100, preexec_fn=limit)  # fmt: skip

    long_name = mbridge("out/" + "p" * 240)
    assert long_name.returncode == 2 and "Traceback" not in long_name.stderr, long_name.stderr[-3000:]
    assert "--output-prefix: cannot create 'out/pppp" in long_name.stderr and "File name too long" in long_name.stderr
    full = mbridge("out/corpus", max_file_bytes=20_000)
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert "writing out/corpus_*.bin/.idx failed: File too large; nothing was written under the output names" in full.stderr
    assert os.listdir(tmp_path / "out") == []


def _preprocess_process(tmp_path, *argv):
    """`mbridge data preprocess` in a fresh process, in `tmp_path`."""
    import subprocess
    import sys

    from factories import source_tree_env

    return subprocess.run([sys.executable, "-m", "megatron_bridge", "data", "preprocess", *argv, "--no-progress"],
                          cwd=tmp_path, env=source_tree_env(), capture_output=True, text=True, timeout=100)  # fmt: skip


@pytest.mark.timeout(120)
def test_a_key_given_twice_is_refused_instead_of_writing_its_documents_twice(tok_dir, tmp_path):
    """Each key has one output: `--json-keys text text` wrote every document twice into it."""
    write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in documents(5)])
    refused = _preprocess_process(tmp_path, "--input", "corpus.jsonl", "--output-prefix", "out/c", "--tokenizer", tok_dir, "--json-keys", "text", "text")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "--json-keys: 'text' given more than once (name each key once)" in refused.stderr
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


@pytest.mark.timeout(120)
def test_an_input_without_documents_is_refused_and_leaves_no_output(tok_dir, tmp_path):
    """An empty file, or a key empty in every row, gave a 0-document dataset (exit status 0) that
    no training can draw from: now exit status 2, nothing under the output names."""
    (tmp_path / "empty.jsonl").write_text("")
    write_jsonl(tmp_path / "blank.jsonl", [{"text": "", "title": "A title."}, {"text": "", "title": "Another."}])
    (tmp_path / "out").mkdir()
    empty = _preprocess_process(tmp_path, "--input", "empty.jsonl", "--output-prefix", "out/e", "--tokenizer", tok_dir)
    assert empty.returncode == 2 and "Traceback" not in empty.stderr, empty.stderr
    assert "--input 'empty.jsonl' holds no documents; nothing was written (give a non-empty input)" in empty.stderr
    blank = _preprocess_process(tmp_path, "--input", "blank.jsonl", "--output-prefix", "out/b", "--tokenizer", tok_dir, "--json-keys", "title", "text")
    assert blank.returncode == 2 and "Traceback" not in blank.stderr, blank.stderr
    assert "--input 'blank.jsonl': 'text' empty in all 2 rows (megatron-core's datasets need a document with tokens); " \
           "nothing was written (choose --json-keys with text)" in blank.stderr  # fmt: skip
    assert os.listdir(tmp_path / "out") == []
