"""`evaluate()` and `mbridge eval`: the loss of text agrees with transformers (one document at a
time, truncated, and in pretraining windows; JSONL and .bin/.idx), fine-tuning data counts its
loss mask, multiple-choice predictions match a transformers reference, and a LoRA checkpoint
scores as its merged export."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random

import pytest
import torch
from inference_models import hf_tokenizer, mbridge, tiny_hf_model, transformers_logprobs, transformers_model
from text_data import OBJECTS, PLACES, SUBJECTS, VERBS, documents, write_jsonl

from megatron_bridge.inference import evaluate

pytestmark = pytest.mark.timeout(600)

SEQ = 24


@pytest.fixture(scope="module", autouse=True)
def one_process():
    with pytest.MonkeyPatch.context() as mp:
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            mp.delenv(name, raising=False)
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama (Hugging Face directory) and evaluation files."""
    root = tmp_path_factory.mktemp("eval")
    model = tiny_hf_model("llama", root / "llama")
    docs = documents(12, seed=7, sentences=(1, 4))
    write_jsonl(root / "docs.jsonl", [{"body": d, "id": i} for i, d in enumerate(docs)])
    return {"root": root, "model": model, "docs": docs, "text": str(root / "docs.jsonl")}


def reference_loss(model, sequences: list[list[int]]) -> tuple[float, int]:
    """transformers' mean next-token NLL over all the sequences' predictions."""
    total, count = 0.0, 0
    for ids in sequences:
        if len(ids) >= 2:
            total -= transformers_logprobs(model, ids).sum().item()
            count += len(ids) - 1
    return total / count, count


def test_text_loss_equals_transformers_per_document_truncated_and_in_windows(files):
    hf = transformers_model(files["model"])
    tok = hf_tokenizer(files["model"])
    encoded = [tok.encode(d).ids for d in files["docs"]]
    assert max(len(ids) for ids in encoded) > SEQ  # truncation matters
    for seq_length in (None, SEQ):
        result = evaluate(files["model"], files["text"], text_key="body", seq_length=seq_length)
        loss, count = reference_loss(hf, [ids[: seq_length or 10**9] for ids in encoded])
        assert (result.format, result.sequences, result.tokens) == ("text", len(encoded), count)
        assert abs(result.loss - loss) / loss < 1e-4, (result.loss, loss)

    # pretraining windows: documents + end-of-document, SEQ + 1 tokens overlapping by one
    stream = [t for d in files["docs"] for t in tok.encode(d, add_special_tokens=False).ids + [tok.token_to_id("<|endoftext|>")]]
    windows = [stream[s : s + SEQ + 1] for s in range(0, len(stream) - 1, SEQ)]
    loss, count = reference_loss(hf, windows)
    joined = evaluate(files["model"], files["text"], text_key="body", seq_length=SEQ, concat=True)
    assert joined.tokens == count == len(stream) - 1 and abs(joined.loss - loss) / loss < 1e-4

    # the same documents as an indexed dataset (mbridge data preprocess --append-eod)
    from megatron_bridge.data.preprocess import PreprocessOptions, preprocess

    prefix = str(files["root"] / "docs")
    preprocess(PreprocessOptions(input=files["text"], output_prefix=prefix, tokenizer=files["model"], json_keys=["body"],
                                 append_eod=True, progress=False))  # fmt: skip
    indexed = evaluate(files["model"], prefix + "_body_document.bin", seq_length=SEQ, concat=True)
    assert (indexed.format, indexed.tokens) == ("indexed", joined.tokens) and abs(indexed.loss - joined.loss) < 1e-9


def test_finetuning_data_counts_the_answer_tokens(files):
    rows = [{"input": f"{s} {v}", "output": f" {o}."} for s, v, o in zip(SUBJECTS, VERBS, OBJECTS)]
    path = files["root"] / "sft.jsonl"
    write_jsonl(path, rows)
    hf = transformers_model(files["model"])
    tok = hf_tokenizer(files["model"])
    eod = tok.token_to_id("<|endoftext|>")
    total, count = 0.0, 0
    for row in rows:
        prompt, answer = tok.encode(row["input"], add_special_tokens=False).ids, tok.encode(row["output"], add_special_tokens=False).ids
        logprobs = transformers_logprobs(hf, prompt + answer + [eod])
        total -= logprobs[len(prompt) - 1 :].sum().item()  # predictions of the answer and the end-of-document token
        count += len(answer) + 1
    result = evaluate(files["model"], str(path))
    assert (result.format, result.tokens) == ("sft", count)
    assert abs(result.loss - total / count) / result.loss < 1e-4


def choice_items(n: int) -> list[dict]:
    rng = random.Random(11)
    items = []
    for i in range(n):
        context = f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)}" + (" " if i % 5 == 0 else "")
        choices = rng.sample([f" {o} {p}" if i % 2 else f" {o}" for o in OBJECTS for p in PLACES[:1]], 4)
        if i % 5 == 0:
            choices = [c.lstrip() for c in choices]  # the context's trailing space moves to the choice
        items.append({"context": context, "choices": choices, "label": rng.randrange(4)})
    return items


def reference_choices(model, tok, items: list[dict]) -> tuple[list[int], list[int]]:
    """The harness convention, by hand: log-likelihood of each choice's tokens after the context."""
    picks, picks_norm = [], []
    for item in items:
        context = item["context"].rstrip()
        lls = []
        for choice in item["choices"]:
            continuation = item["context"][len(context) :] + choice
            head = tok.encode(context, add_special_tokens=False).ids
            whole = tok.encode(context + continuation, add_special_tokens=False).ids
            lls.append(transformers_logprobs(model, whole)[len(head) - 1 :].sum().item())
        picks.append(max(range(4), key=lambda k: lls[k]))
        picks_norm.append(max(range(4), key=lambda k: lls[k] / len(item["choices"][k])))
    return picks, picks_norm


def test_multiple_choice_and_cli(files, tmp_path):
    items = choice_items(50)
    path = files["root"] / "choices.jsonl"
    write_jsonl(path, items)
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [{"question": "?"}])
    runs = {
        "choice": ("eval", files["model"], "--data", str(path), "--json"),
        "text": ("eval", files["model"], "--data", files["text"], "--text-key", "body", "--json"),
        "bad_data": ("eval", files["model"], "--data", str(bad)),
        "no_data": ("eval", files["model"], "--data", str(tmp_path / "none.jsonl")),
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(mbridge, *args) for key, args in runs.items()}
        hf = transformers_model(files["model"])
        picks, picks_norm = reference_choices(hf, hf_tokenizer(files["model"]), items)
        result = evaluate(files["model"], str(path))
        procs = {key: f.result() for key, f in futures.items()}
    assert result.predictions == picks
    accuracy = sum(p == it["label"] for p, it in zip(picks, items)) / 50
    accuracy_norm = sum(p == it["label"] for p, it in zip(picks_norm, items)) / 50
    assert (result.format, result.sequences, result.accuracy, result.accuracy_norm) == ("choice", 50, accuracy, accuracy_norm)

    for key in ("choice", "text"):
        assert procs[key].returncode == 0, procs[key].stderr[-3000:]
    line = json.loads(procs["choice"].stdout.strip().splitlines()[-1])
    assert set(line) == {"loss", "perplexity", "tokens", "accuracy"} and line["accuracy"] == accuracy
    assert abs(line["loss"] - result.loss) < 1e-9 and line["tokens"] == result.tokens
    line = json.loads(procs["text"].stdout.strip().splitlines()[-1])
    tok = hf_tokenizer(files["model"])
    loss, count = reference_loss(hf, [tok.encode(d).ids for d in files["docs"]])
    assert set(line) == {"loss", "perplexity", "tokens"} and line["tokens"] == count
    assert abs(line["loss"] - loss) / loss < 1e-4 and abs(line["perplexity"] - torch.tensor(loss).exp().item()) < 1e-6 * line["perplexity"]
    for key, message in (("bad_data", "match no evaluation format: text needs 'text' (--text-key)"), ("no_data", "does not exist")):
        assert procs[key].returncode == 2 and message in procs[key].stderr and "Traceback" not in procs[key].stderr, procs[key].stderr


def test_data_errors_are_one_message(files, tmp_path):
    from megatron_bridge.config.errors import ConfigValidationError
    from megatron_bridge.inference.errors import DataError

    path = tmp_path / "choices.jsonl"
    write_jsonl(path, [{"context": "a", "choices": ["b", "c"], "label": 2}])
    with pytest.raises(DataError, match=r"choices.jsonl:1: 'label' must be the index of the right choice \(0 to 1\), found 2"):
        evaluate(files["model"], str(path))
    with pytest.raises(DataError, match="--concat joins documents of text or indexed data, not choice data"):
        evaluate(files["model"], str(path), concat=True)
    with pytest.raises(ConfigValidationError, match="backend: unknown process-group backend 'cpu'"):
        evaluate(files["model"], str(path), backend="cpu")
    with pytest.raises(DataError, match="--seq-length 100000 is longer than the model's sequence length 16384"):
        evaluate(files["model"], files["text"], text_key="body", seq_length=100000)
    write_jsonl(path, [{"body": "text"}, {"body": 3}])
    with pytest.raises(DataError, match=r"choices.jsonl:2: no text in 'body'"):
        evaluate(files["model"], str(path), text_key="body")


# ---------------------------------------------------------------------- LoRA
@pytest.fixture(scope="module")
def lora(files, tmp_path_factory):
    """The tiny Llama imported (the base), LoRA adapters trained on it for 4 iterations, and
    their merged checkpoint and its Hugging Face export."""
    from megatron_bridge.models.hf.convert import checkpoint_provider, export_checkpoint, import_hf
    from megatron_bridge.peft import LoRA
    from megatron_bridge.peft.merge import merge_checkpoint
    from megatron_bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        MockGPTDatasetConfig,
        OptimizerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron_bridge.training.finetune import finetune
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    root = tmp_path_factory.mktemp("lora")
    base = str(root / "base")
    import_hf(files["model"], base)
    model = checkpoint_provider(os.path.join(base, "iter_0000000"))
    model.seq_length = SEQ
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=4, global_batch_size=4, micro_batch_size=2),
        optimizer=OptimizerConfig(lr=2e-2, min_lr=2e-3),
        dataset=MockGPTDatasetConfig(seq_length=SEQ, num_workers=0),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=files["model"]),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        checkpoint=CheckpointConfig(pretrained_checkpoint=base, save=str(root / "adapters")),
    )
    cfg.peft = LoRA(dim=4, alpha=8)
    finetune(cfg, forward_step)
    merged = str(root / "merged")
    merge_checkpoint(str(root / "adapters"), merged)
    export_checkpoint(merged, str(root / "merged_hf"), dtype="fp32")
    return {"base": base, "adapters": str(root / "adapters"), "merged": merged, "merged_hf": str(root / "merged_hf")}


@pytest.fixture(scope="module")
def lora_results(files, lora):
    return {key: evaluate(path, files["text"], text_key="body", seq_length=SEQ) for key, path in lora.items()}


def test_lora_checkpoint_scores_as_its_merged_export(lora_results):
    adapted, merged, exported, base = (lora_results[k] for k in ("adapters", "merged", "merged_hf", "base"))
    assert adapted.tokens == merged.tokens == exported.tokens == base.tokens
    assert abs(adapted.loss - merged.loss) < 1e-5 and abs(adapted.loss - exported.loss) < 1e-5
    assert abs(adapted.loss - base.loss) > 1e-3  # the adapters changed the model


def test_adapters_without_their_base(files, lora, lora_results):
    moved = lora["base"] + ".moved"
    os.rename(lora["base"], moved)
    try:
        proc = mbridge("eval", lora["adapters"], "--data", files["text"], "--text-key", "body")
        given = evaluate(lora["adapters"], files["text"], text_key="body", seq_length=SEQ, base=moved)
    finally:
        os.rename(moved, lora["base"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "holds only the adapters of a LoRA run, and their base model is missing" in proc.stderr
    assert "give the base checkpoint or Hugging Face directory with --base DIR" in proc.stderr
    assert given.loss == lora_results["adapters"].loss
