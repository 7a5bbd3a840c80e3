"""Hugging Face model directories in and out: `config.json` <-> model providers, safetensors
weights <-> megatron-core parameters, for the families the family modules register
(`registry`; what a family defines: `family.HFFamily`).

Importing this package is cheap; the submodules that move weights import torch and megatron-core
when used. Converting weights needs `config.json` and safetensors files only (the `hf` extra), not
`transformers`.
"""

from __future__ import annotations

from megatron_bridge.models.hf.files import is_hf_directory

__all__ = ["is_hf_directory", "provider_from_hf"]


def provider_from_hf(path: str):
    """The family provider for the Hugging Face model directory (or config.json file) `path`."""
    from megatron_bridge.models.hf.config import provider_from_hf as build

    return build(path)
