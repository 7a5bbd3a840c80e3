"""Test-only: tiny Hugging Face models with a tokenizer (for generation and evaluation), their
transformers references, and `mbridge` run in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from factories import source_tree_env
from hf_models import family_configs, hf_reference_model, save_tiny
from text_data import train_tokenizer

VOCAB = 320
"""The models' vocabulary: the tokenizer's 300 ids and padding rows, as real models have."""


def tiny_hf_model(name: str, directory, chat_template=None) -> str:
    """The tiny `name` model (fp32, random weights) with a 300-token BPE tokenizer."""
    config = family_configs()[name]
    config.vocab_size = VOCAB
    save_tiny(name, str(directory), config=config)
    train_tokenizer(str(directory), vocab_size=300, chat_template=chat_template)
    return str(directory)


def hf_tokenizer(directory: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))


def transformers_model(directory: str):
    return hf_reference_model(directory)


def transformers_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, float64."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(tokens).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]


def mbridge(*args: str, timeout: int = 240, **env: str) -> subprocess.CompletedProcess:
    """`python -m megatron_bridge ARGS` in a fresh process (this checkout first on the path;
    `env` added to the environment)."""
    return subprocess.run([sys.executable, "-m", "megatron_bridge", *args], capture_output=True, text=True,
                          timeout=timeout, env=source_tree_env(**env))  # fmt: skip
