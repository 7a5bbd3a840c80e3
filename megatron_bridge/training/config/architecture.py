"""A validation rule: the checkpoints a run loads weights from were saved with the config's model
architecture (`check_loaded_architectures`, from their run_config.yaml, before anything is
built), and their pickled files name nothing but checkpoint data. The same fields are checked
again when the weights are loaded (`megatron_bridge.training.checkpointing.compat`)."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from megatron_bridge.config.errors import Problems, show
from megatron_bridge.runtime.checkpointing.run_config import read_run_config
from megatron_bridge.config.serialization import to_dict
from megatron_bridge.runtime.checkpointing.layout import has_checkpoint, resolve
from megatron_bridge.runtime.checkpointing.safe_reading import UnsafeCheckpointError, check_pickled_files
from megatron_bridge.models.hf.files import is_hf_directory

logger = logging.getLogger(__name__)

TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
"""Tokenizer fields that choose the token ids a model was trained on."""

ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "normalization",
    "gated_linear_unit",
    "activation_func",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "position_embedding_type",
    "vocab_size",
    "share_embeddings_and_output_weights",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "input_layernorms",
    "output_layernorms",
    "qk_layernorm_per_head",
)
"""Model fields that decide the shapes and meaning of the weights."""


def loaded_checkpoints(cfg: Any) -> list[tuple[str, str, Optional[int]]]:
    """(config field, path, ckpt_step) of each checkpoint of ours whose weights a run of `cfg`
    loads, as the checkpoint manager chooses them: a resumable `load`, else `pretrained_checkpoint`;
    a PEFT run loads both (the base, then its adapters)."""
    c = cfg.checkpoint
    resume = bool(c.load) and has_checkpoint(c.load)
    loads_base = cfg.peft is not None or not resume
    found = []
    if c.pretrained_checkpoint and not is_hf_directory(c.pretrained_checkpoint) and loads_base:
        found.append(("checkpoint.pretrained_checkpoint", c.pretrained_checkpoint, None if resume else c.ckpt_step))
    if resume:
        found.append(("checkpoint.load", c.load, c.ckpt_step))
    return found


def check_loaded_architectures(cfg: Any, problems: Problems) -> None:
    """The checkpoints of ours that the run loads weights from were saved with the config's model
    architecture (their run_config.yaml against the model section): a mismatch is reported
    before the model is built. Which checkpoints: see `loaded_checkpoints`. Fields the config
    leaves to be derived later (the vocabulary size from a tokenizer) are compared at loading.
    A checkpoint whose `.metadata` names code to run is reported too (`safe_reading`)."""
    current = None  # encoded only when there is a saved model to compare with (rarely)
    for field, path, step in loaded_checkpoints(cfg):
        try:
            directory = resolve(path, step)[0]
            check_pickled_files(directory)
        except UnsafeCheckpointError as exc:
            problems.add(field, exc.problem, exc.fix)
            continue
        except (OSError, ValueError):
            continue  # no readable checkpoint there: reported when it is loaded
        try:
            run_config = read_run_config(directory)
            saved = run_config.section("model") if run_config is not None else {}
        except (OSError, ValueError):
            continue  # no readable checkpoint there: reported when it is loaded
        if not saved:
            continue  # a directory without our run config, or one without a model section
        if field == "checkpoint.load":
            _warn_of_another_tokenizer(path, run_config.section("tokenizer"), cfg.tokenizer)
        current = to_dict(cfg.model) if current is None else current
        fields = differing_fields(saved, current, "checkpoint", "config")
        if not fields:
            continue
        problems.add(
            field,
            f"{path!r} holds a {_describe(saved)}, but the config's model is a {_describe(current)} ({fields})",
            "point it at a checkpoint of this architecture, or use the checkpoint's model (e.g. the matching recipe)",
        )


def _warn_of_another_tokenizer(path: str, saved: dict, tokenizer: Any) -> None:
    """A run resumed with another tokenizer than its checkpoint's reads other token ids for the
    same text. The files may only have moved, so this is a warning, not an error."""
    def same(name: str, before: Any, now: Any) -> bool:
        if name != "tokenizer_type" and isinstance(before, str) and isinstance(now, str):
            return os.path.abspath(before) == os.path.abspath(now)
        return before == now

    changed = [
        f"{name} {show(saved.get(name))} -> {show(getattr(tokenizer, name))}"
        for name in TOKENIZER_FIELDS
        if name in saved and not same(name, saved[name], getattr(tokenizer, name))
    ]  # fmt: skip
    if changed:
        logger.warning(
            "resuming from %r with another tokenizer than it was trained with (tokenizer.%s): the same text "
            "becomes other token ids unless the files only moved; give the run's tokenizer to continue it",
            path, "; tokenizer.".join(changed),
        )


def differing_fields(first: dict, second: dict, first_name: str, second_name: str) -> str:
    """'hidden_size: checkpoint 64, config 96; ...' for the architecture fields where two model
    sections differ ('' when none does); a field the second leaves unset is not compared."""
    differing = [
        n for n in ARCHITECTURE_FIELDS
        if n in first and second.get(n) is not None and first[n] != second[n]
    ]  # fmt: skip
    return "; ".join(f"{n}: {first_name} {show(first[n])}, {second_name} {show(second[n])}" for n in differing)


def base_mismatch(adapters_model: dict, base: str) -> Optional[str]:
    """Why the weights at `base` (a checkpoint of ours or a Hugging Face directory) cannot be the
    base of adapters trained on `adapters_model` (the model section of their run config), or None
    when they can (or `base` describes no model: its loading reports that)."""
    if is_hf_directory(base):
        from megatron_bridge.models import GPTModelProvider

        base_model = to_dict(GPTModelProvider.from_hf(base))
    else:
        try:
            run_config = read_run_config(resolve(base)[0])
        except (OSError, ValueError):
            return None
        base_model = run_config.section("model") if run_config is not None else {}
    if not base_model:
        return None
    fields = differing_fields(base_model, adapters_model, "base", "adapters")
    if not fields:
        return None
    return (
        f"{base!r} holds a {_describe(base_model)}, but the adapters were trained on a {_describe(adapters_model)} "
        f"({fields}); give the base they were trained on, or leave it out to use the one they record"
    )


def _describe(model: dict) -> str:
    """'LlamaModelProvider (32 layers, hidden size 4096, 32 attention heads)' from a model section."""
    kind = str(model.get("_target_") or "GPTModelProvider").rsplit(".", 1)[-1]
    sizes = [
        text.format(model[key])
        for key, text in (("num_layers", "{} layers"), ("hidden_size", "hidden size {}"),
                          ("num_attention_heads", "{} attention heads"), ("num_moe_experts", "{} experts"))
        if model.get(key)
    ]  # fmt: skip
    return f"{kind} ({', '.join(sizes)})" if sizes else kind
