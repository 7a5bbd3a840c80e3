"""The SentencePiece tokenizers (a local tokenizer.model) as Megatron-LM defines them: Llama 2's
starts every text with BOS, the GPT one adds nothing, the plain one appends Megatron-LM's special
tokens and sentinels and keeps them whole in text; preprocessing with one, and file problems."""

from __future__ import annotations

import io

import pytest
from text_data import documents, write_jsonl

from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.training.tokenizers.config import TokenizerConfig

spm = pytest.importorskip("sentencepiece", reason="the sentencepiece extra is not installed")

TEXT = "The cat sees the red ball. café 東京"


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A tiny SentencePiece BPE model trained on test text (unk 0, bos 1, eos 2, no pad)."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(documents(300, seed=3) + ["café naïve 東京"] * 20), model_writer=out, vocab_size=200,
        model_type="bpe", character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(out.getvalue())
    return str(path)


def _build(kind, model_file, **kw):
    from megatron_bridge.runtime.tokenizers.tokenizer import build_tokenizer

    cfg = TokenizerConfig(tokenizer_type=kind, tokenizer_model=model_file, **kw)
    cfg.finalize()
    return build_tokenizer(cfg)


def test_llama2_gpt_and_plain_sentencepiece_tokenizers(model_file):
    sp = spm.SentencePieceProcessor(model_file=model_file)
    pieces = sp.encode(TEXT)

    llama = _build("Llama2Tokenizer", model_file)
    assert llama.tokenize(TEXT) == [1, *pieces] and (llama.bos, llama.eod, llama.pad, llama.vocab_size) == (1, 2, -1, 200)
    assert llama.detokenize(llama.tokenize(TEXT)) == TEXT

    gpt = _build("GPTSentencePieceTokenizer", model_file)
    assert gpt.tokenize(TEXT) == pieces and gpt.eod == 2 and gpt.vocab_size == 200

    plain = _build("SentencePieceTokenizer", model_file, vocab_extra_ids=2)
    # <CLS> <SEP> <EOD> <MASK> <PAD> appended (the model has <s> and </s>), then two sentinels
    assert plain.vocab_size == 200 + 5 + 2 and plain.eod == 202 and plain.pad == 204 and plain.bos == 1
    ids = plain.tokenize("cat<EOD>dog<extra_id_1></s>")
    assert ids == [*sp.encode("cat"), 202, *sp.encode("dog"), 206, 2]
    # as Megatron-LM decodes: each special token between spaces, after the (here empty) text before it
    assert plain.detokenize(ids) == "cat <EOD> dog <extra_id_1>  </s> "

    with pytest.raises(ConfigValidationError) as info:
        TokenizerConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=model_file, vocab_extra_ids=3, special_tokens=["<x>"]).finalize()
    text = str(info.value)
    assert "vocab_extra_ids: Llama2Tokenizer adds no tokens to its model's vocabulary" in text
    assert "special_tokens: Llama2Tokenizer adds no tokens given by name" in text


def test_preprocess_with_llama2_and_file_problems(model_file, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_bridge.data import preprocess as pre
    from megatron_bridge.data.checks import build_checked_tokenizer
    from tests.factories import tiny_config

    texts = documents(20, seed=4)
    write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    options = pre.PreprocessOptions(
        input=str(tmp_path / "docs.jsonl"), output_prefix=str(tmp_path / "d"), tokenizer=model_file,
        tokenizer_type="Llama2Tokenizer", append_eod=True, progress=False,
    )  # fmt: skip
    pre.preprocess(options)
    ds = IndexedDataset(str(tmp_path / "d_text_document"))  # kept: its samples are views of its memory map
    sp = spm.SentencePieceProcessor(model_file=model_file)
    assert ds[5].tolist() == [1, *sp.encode(texts[5]), 2]  # BOS, the text, end-of-document

    (tmp_path / "not.model").write_text("not a model")
    cases = {
        str(tmp_path / "missing.model"): ["missing.model' does not exist", "point it at the local SentencePiece tokenizer.model"],
        str(tmp_path / "not.model"): ["is not a SentencePiece model (it does not parse as one)", "use the SentencePiece model file"],
    }
    for path, expected in cases.items():
        cfg = tiny_config(tokenizer=TokenizerConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=path))
        cfg.tokenizer.finalize()
        with pytest.raises(ConfigValidationError) as info:
            build_checked_tokenizer(cfg)
        assert f"tokenizer.tokenizer_model: {path!r}" in str(info.value), str(info.value)
        assert all(part in str(info.value) for part in expected), str(info.value)


def test_export_writes_the_sentencepiece_model_as_tokenizer_model(model_file, tmp_path, caplog):
    from megatron_bridge.models.hf.convert import exported_tokenizer

    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        files = exported_tokenizer(TokenizerConfig(tokenizer_type=kind, tokenizer_model=model_file))
        assert files == {"tokenizer.model": open(model_file, "rb").read()}
    missing = str(tmp_path / "gone.model")
    assert exported_tokenizer(TokenizerConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=missing)) is None
    assert "the SentencePiece tokenizer is not exported" in caplog.text and "gone.model" in caplog.text
