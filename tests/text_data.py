"""Test text and tokenizers trained on it (BPE, saved to a temp directory): no downloads."""

from __future__ import annotations

import json
import os
import random

SUBJECTS = ["the cat", "a dog", "my sister", "the old man", "our teacher", "the small bird", "a farmer", "the robot"]
VERBS = ["sees", "likes", "finds", "paints", "follows", "carries", "builds", "remembers"]
OBJECTS = ["the red ball", "a green house", "the river", "an apple", "the blue door", "a quiet song", "the map", "a wooden box"]
PLACES = ["in the garden", "near the station", "at night", "after lunch", "on the hill", "by the sea"]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML-style template (the one the chat tests render with)."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.5:
        s += f" {rng.choice(PLACES)}"
    return s[0].upper() + s[1:] + "."


def document(rng: random.Random, sentences: tuple[int, int] = (2, 8)) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(*sentences)))


def documents(n: int, seed: int = 0, sentences: tuple[int, int] = (2, 8)) -> list[str]:
    rng = random.Random(seed)
    return [document(rng, sentences) for _ in range(n)]


def write_jsonl(path, rows) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def train_tokenizer(directory, vocab_size: int = 300, texts=None, chat_template: str | None = None) -> str:
    """A byte-level BPE tokenizer trained on test text, saved as tokenizer.json (+ its
    tokenizer_config.json naming eos/pad and the chat template) in `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(directory, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = texts if texts is not None else documents(400, seed=123) + ["user assistant system question answer"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    settings = {"eos_token": "<|endoftext|>", "pad_token": "<pad>"}
    if chat_template:
        settings["chat_template"] = chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f)
    return str(directory)
