"""GPT-2's BPE tokenizer from vocab.json + merges.txt: the same ids as transformers' GPT-2
tokenizer, preprocessing and pretraining with it (its vocabulary sizes the model, the saved run
config names it, generation reloads it), its file problems, and the tokenizer types refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from text_data import documents, write_jsonl

from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.runtime.tokenizers.gpt2_bpe import EOD_TOKEN, GPT2BPETokenizer
from megatron_bridge.training.tokenizers.config import TokenizerConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = [
    "The cat sees the red ball in the garden.",
    "  two  spaces,\ttabs\nand newlines\n\n",
    "café naïve Zürich 東京 – 🙂 ok",
    f"first document{EOD_TOKEN}second document",
    "unseenwordsxyz 12345 !?",
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """GPT-2-style files of a byte-level BPE trained on test text (non-ASCII included)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("gpt2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOD_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(documents(300, seed=5) + ["café naïve Zürich 東京 🙂"] * 10, trainer)
    tok.model.save(str(directory))  # vocab.json + merges.txt
    return directory


def test_ids_match_transformers_gpt2_tokenizer(bpe_dir):
    from transformers import GPT2TokenizerFast

    ours = GPT2BPETokenizer(str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt"))
    theirs = GPT2TokenizerFast.from_pretrained(str(bpe_dir), local_files_only=True)
    assert ours.eod == theirs.eos_token_id and ours.vocab_size == len(theirs) == 400
    for text in SAMPLES:
        ids = ours.tokenize(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.encode(text) == ids  # GPT-2 adds no special tokens
        assert ours.detokenize(ids, skip_special_tokens=False) == theirs.decode(ids) == text
    assert ours.tokenize_batch(SAMPLES) == [theirs(t)["input_ids"] for t in SAMPLES]
    assert ours.eod in ours.tokenize(SAMPLES[3])  # the end-of-document token is never split
    more = GPT2BPETokenizer(str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt"), special_tokens=["<x>"], extra_ids=2)
    assert more.vocab_size == 403 and more.tokenize("a<x>b<extra_id_1>")[1::2] == [400, 402]
    ids, offsets = ours.tokenize_with_offsets("café ok")
    assert len(ids) == len(offsets) and offsets[-1][1] == len("café ok")


def test_file_problems_name_the_field_value_and_fix(bpe_dir, tmp_path):
    from megatron_bridge.data.checks import build_checked_tokenizer
    from tests.factories import tiny_config

    vocab, merges = str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt")
    (tmp_path / "not.json").write_text("{not json")
    (tmp_path / "bad_merges.txt").write_text("#version: 0.2\nĠ t h\n")
    (tmp_path / "other_merges.txt").write_text("#version: 0.2\nq z\n")
    cases = {
        (str(tmp_path / "missing.json"), merges): ["tokenizer.vocab_file", "missing.json' does not exist", "vocab.json of GPT-2's BPE"],
        (vocab, str(tmp_path)): ["tokenizer.merge_file", "is a directory, not a file"],
        (str(tmp_path / "not.json"), merges): ["tokenizer.vocab_file", "is not JSON", "use the BPE's own vocab.json"],
        (vocab, str(tmp_path / "bad_merges.txt")): ["tokenizer.merge_file", "line 2", "not two tokens separated by a space"],
        (vocab, str(tmp_path / "other_merges.txt")): ["tokenizer.merge_file", "'q z'", "of different tokenizers"],
    }
    for (v, m), expected in cases.items():
        cfg = tiny_config(tokenizer=TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=v, merge_file=m))
        cfg.tokenizer.finalize()
        with pytest.raises(ConfigValidationError) as info:
            build_checked_tokenizer(cfg)
        for part in expected:
            assert part in str(info.value), (v, m, str(info.value))

    with pytest.raises(ConfigValidationError) as info:
        TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab).finalize()
    assert "merge_file: GPT2BPETokenizer needs GPT-2's merges.txt, got None" in str(info.value)
    with pytest.raises(ConfigValidationError) as info:
        TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=8, merge_file=merges, tiktoken_num_special_tokens=5).finalize()
    text = str(info.value)
    assert "merge_file: only a GPT2BPETokenizer reads it" in text and "tokenizer.tokenizer_type=GPT2BPETokenizer" in text
    assert "tiktoken_num_special_tokens=5 is not supported: read only by TikTokenizer" in text


@pytest.mark.timeout(240)
def test_preprocess_pretrain_and_reload_from_the_checkpoint(bpe_dir, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_bridge.data import preprocess as pre
    from megatron_bridge.inference.source_tokenizer import load_tokenizer
    from megatron_bridge.inference.sources import read_run_config, resolve
    from megatron_bridge.training.config import CheckpointConfig, GPTDatasetConfig, TrainingConfig
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain
    from tests.factories import tiny_config, tiny_llama_model

    vocab, merges = str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt")
    texts = documents(200, seed=9)
    write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    options = pre.PreprocessOptions(
        input=str(tmp_path / "docs.jsonl"), output_prefix=str(tmp_path / "d"), tokenizer_type="GPT2BPETokenizer",
        vocab_file=vocab, merge_file=merges, append_eod=True, progress=False,
    )  # fmt: skip
    assert pre.preprocess(options)["text"].documents == 200
    tok = GPT2BPETokenizer(vocab, merges)
    prefix = str(tmp_path / "d_text_document")
    ds = IndexedDataset(prefix)  # kept: its samples are views of its memory map
    assert ds[3].tolist() == tok.tokenize(texts[3]) + [tok.eod]

    cfg = tiny_config(
        train=TrainingConfig(train_iters=3, global_batch_size=4, micro_batch_size=2),
        model=tiny_llama_model(vocab_size=None),  # an architecture Hugging Face has, to export it
        dataset=GPTDatasetConfig(seq_length=32, data_path=prefix, split="98,1,1", num_workers=0),
        tokenizer=TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges),
        checkpoint=CheckpointConfig(save=str(tmp_path / "ckpt"), save_interval=3),
    )
    cfg.validation.eval_iters = 0
    state = pretrain(cfg, forward_step)
    assert state.train_state.step == 3
    assert cfg.model.vocab_size >= 400  # taken from the tokenizer (then padded)
    source = resolve(str(tmp_path / "ckpt"))
    saved = read_run_config(source.directory)
    assert saved.value("tokenizer", "tokenizer_type") == "GPT2BPETokenizer"
    assert (saved.value("tokenizer", "vocab_file"), saved.value("tokenizer", "merge_file")) == (vocab, merges)
    assert saved.value("model", "vocab_size") == cfg.model.vocab_size
    reloaded = load_tokenizer(source)  # as generation and evaluation load it
    assert isinstance(reloaded, GPT2BPETokenizer) and reloaded.tokenize(SAMPLES[2]) == tok.tokenize(SAMPLES[2])

    # exported to Hugging Face, the tokenizer comes along and transformers reads the same ids
    from transformers import AutoTokenizer

    from megatron_bridge.models.hf.convert import export_checkpoint

    out = str(tmp_path / "hf")
    export_checkpoint(str(tmp_path / "ckpt"), out)
    theirs = AutoTokenizer.from_pretrained(out, local_files_only=True)
    for text in SAMPLES:
        assert theirs(text, add_special_tokens=False)["input_ids"] == tok.tokenize(text), text
    assert theirs.eos_token_id == tok.eod


def test_refused_tokenizer_types_say_what_to_use_instead():
    from megatron_bridge.runtime.tokenizers.config import REFUSED_TYPES

    assert set(REFUSED_TYPES) == {
        "TikTokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer",
    }  # fmt: skip
    for kind, fix in REFUSED_TYPES.items():
        with pytest.raises(ConfigValidationError) as info:
            TokenizerConfig(tokenizer_type=kind, tokenizer_model="x").finalize()
        assert f"tokenizer_type: {kind!r} is not supported here ({fix})" in str(info.value)
        assert "HuggingFaceTokenizer" in fix or "NullTokenizer" in fix
    bert = TokenizerConfig(tokenizer_type="BertWordPieceLowerCase")
    with pytest.raises(ConfigValidationError, match=r"BertTokenizerFast\('vocab.txt', do_lower_case=True\)"):
        bert.finalize()


def _mbridge(*argv: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_bridge", *argv], cwd=cwd, capture_output=True, text=True, timeout=200)


@pytest.mark.timeout(240)
def test_cli_refuses_unsupported_tokenizers_and_incomplete_gpt2_flags(bpe_dir, tmp_path):
    env_cwd = REPO
    run = _mbridge(
        "pretrain", "--recipe", "tiny_gpt_pretrain_config", "--dir", str(tmp_path / "runs"),
        "tokenizer.tokenizer_type=TikTokenizer", f"tokenizer.tokenizer_model={tmp_path}/tokenizer.json",
        "tokenizer.tiktoken_pattern=v2", cwd=env_cwd,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "tokenizer.tokenizer_type: 'TikTokenizer' is not supported here" in out, out
    assert "set tokenizer.tokenizer_type=HuggingFaceTokenizer, tokenizer.tokenizer_model=DIR" in out, out
    assert "tokenizer.tiktoken_pattern: tiktoken_pattern='v2' is not supported: read only by TikTokenizer" in out, out
    assert not os.path.exists(tmp_path / "runs" / "checkpoints"), out

    run = _mbridge(
        "data", "preprocess", "--input", str(tmp_path / "x.jsonl"), "--output-prefix", str(tmp_path / "x"),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(bpe_dir / "vocab.json"), cwd=env_cwd,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "--tokenizer-type GPT2BPETokenizer needs --merge-file" in out, out

    from megatron_bridge.data import preprocess as pre

    write_jsonl(tmp_path / "docs.jsonl", [{"text": SAMPLES[2]}])
    vocab, merges = str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt")
    pre.preprocess(pre.PreprocessOptions(
        input=str(tmp_path / "docs.jsonl"), output_prefix=str(tmp_path / "d"), tokenizer_type="GPT2BPETokenizer",
        vocab_file=vocab, merge_file=merges, progress=False,
    ))  # fmt: skip
    run = _mbridge(
        "data", "inspect", str(tmp_path / "d_text_document"), "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", vocab, "--merge-file", merges, cwd=env_cwd,
    )  # fmt: skip
    assert run.returncode == 0 and repr(SAMPLES[2]) in run.stdout, run.stdout + run.stderr
