"""Fine-tune a tiny Llama from its Hugging Face directory end to end: finetune() reads the
safetensors and the directory's tokenizer, trains 20 iterations, writes the model back as a
Hugging Face directory (checkpoint.save_hf), and transformers computes our last evaluation loss."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import pytest
import torch
from hf_models import save_tiny

from megatron_bridge.models import GPTModelProvider
from megatron_bridge.training.callbacks import Callback
from megatron_bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DatasetProvider,
    OptimizerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron_bridge.training.finetune import finetune
from megatron_bridge.training.gpt_step import forward_step

pytestmark = pytest.mark.timeout(400)

SEQ, EVAL_BATCH = 32, 4
WORDS = {
    "who": ["the cat", "a dog", "my friend", "the old man", "a small bird"],
    "does": ["sat on", "looked at", "walked to", "jumped over", "slept near"],
    "what": ["the mat", "a tree", "the house", "the river", "a red car"],
}


def sentences(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS['who'])} {rng.choice(WORDS['does'])} {rng.choice(WORDS['what'])} ." for _ in range(n))


def train_tokenizer(directory: str) -> None:
    """A small word-level BPE tokenizer (tokenizers only, offline) saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator([sentences(400, 0)], trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>", "unk_token": "<unk>"}, f)


class Windows(torch.utils.data.Dataset):
    """Consecutive windows of SEQ+1 token ids: tokens, next-token labels, every token counted."""

    def __init__(self, ids: list[int], count: int, period: int):
        self.ids, self.count, self.period = ids, count, period

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        start = (i % self.period) * SEQ
        window = torch.tensor(self.ids[start : start + SEQ + 1])
        return {"tokens": window[:-1], "labels": window[1:], "loss_mask": torch.ones(SEQ), "position_ids": torch.arange(SEQ)}


@dataclass
class SentenceData(DatasetProvider):
    """Training windows of one stream of sentences; validation: EVAL_BATCH windows of another."""

    seed: int = 1

    def build_datasets(self, context):
        train_ids = context.tokenizer.tokenize(sentences(600, self.seed))
        valid_ids = context.tokenizer.tokenize(sentences(60, self.seed + 1000))
        train = Windows(train_ids, context.train_samples, (len(train_ids) - 1) // SEQ)
        return train, Windows(valid_ids, context.valid_samples, EVAL_BATCH), None


def held_out_batch(tokenizer_dir: str) -> torch.Tensor:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json")).encode(sentences(60, 1001), add_special_tokens=False).ids
    return torch.stack([torch.tensor(ids[i * SEQ : i * SEQ + SEQ + 1]) for i in range(EVAL_BATCH)])


def transformers_loss(directory: str, windows: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), windows[:, 1:].reshape(-1)).item()


class Evaluations(Callback):
    def __init__(self):
        self.losses = []

    def on_eval_end(self, state, metrics):
        if metrics:
            self.losses.append(metrics["lm loss"])


def test_finetune_from_hugging_face_weights_and_export(tmp_path, monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    source = save_tiny("llama", str(tmp_path / "tiny-llama"), max_shard_size="200KB")
    train_tokenizer(source)
    model = GPTModelProvider.from_hf(source)
    model.seq_length = SEQ
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=20, global_batch_size=4, micro_batch_size=2),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4),
        dataset=SentenceData(num_workers=0),
        validation=ValidationConfig(eval_interval=None, eval_iters=1, eval_global_batch_size=EVAL_BATCH),
        checkpoint=CheckpointConfig(pretrained_checkpoint=source, save=str(tmp_path / "ckpt"), save_hf_weights=True, save_hf_dtype="fp32"),
    )  # no tokenizer named: the directory's is used
    evaluations = Evaluations()
    state = finetune(cfg, forward_step, callbacks=[evaluations])
    assert state.train_state.step == 20
    assert (cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model) == ("HuggingFaceTokenizer", source)
    exported = tmp_path / "ckpt" / "hf_iter_0000020"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= set(os.listdir(exported))

    windows = held_out_batch(source)
    ours = evaluations.losses[-1]
    after = transformers_loss(str(exported), windows)
    before = transformers_loss(source, windows)
    print(f"held-out loss: before {before:.4f}, after {after:.4f}, ours {ours:.4f}")
    assert abs(after - ours) < 1e-4
    assert after < before - 1.0
