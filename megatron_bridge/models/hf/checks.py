"""Config checks for runs that start from, or save, Hugging Face weights.

* `apply_pretrained_defaults` (before the sections finalize): a run starting from a Hugging Face
  directory (or a checkpoint imported from one) uses its tokenizer unless the config names one.
* `pretrained_vocab_size`: the model's vocabulary size when the config leaves it unset.
* `check_pretrained` (with the cross-section checks): the directory's config.json converts, its
  index lists the tensors config.json implies, and the model config has its architecture. Only
  config.json and the index are read, so a dry run works without the weights.
* `check_save_hf`: `checkpoint.save_hf` needs a model with a Hugging Face counterpart.
* `preflight` (in setup, before the model is built): the weight files themselves.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from megatron_bridge.config.errors import Problems, show
from megatron_bridge.models.hf.files import has_tokenizer, hf_origin, is_hf_directory
from megatron_bridge.models.hf.config import architecture_differences, computation_differences, family_of_provider
from megatron_bridge.models.hf.load import check_hf_directory
from megatron_bridge.runtime.checkpointing.layout import has_checkpoint

if TYPE_CHECKING:
    from megatron_bridge.training.config.container import ConfigContainer

logger = logging.getLogger(__name__)

PATH = "checkpoint.pretrained_checkpoint"


def _starts_from_hf(cfg: "ConfigContainer") -> bool:
    """The run's weights come from a Hugging Face directory: it does not resume its own, or it
    is a PEFT run (whose base weights are loaded again on resuming)."""
    c = cfg.checkpoint
    return is_hf_directory(c.pretrained_checkpoint) and (cfg.peft is not None or not has_checkpoint(c.load))


def apply_pretrained_defaults(cfg: "ConfigContainer", problems: Problems) -> None:
    """A run starting from a Hugging Face model uses its tokenizer unless the config names one."""
    tok = cfg.tokenizer
    if tok.tokenizer_type is not None or tok.is_explicit("tokenizer_type") or not cfg.checkpoint.pretrained_checkpoint:
        return
    origin = hf_origin(cfg.checkpoint.pretrained_checkpoint)
    if has_tokenizer(origin):
        tok.apply_default("tokenizer_type", "HuggingFaceTokenizer")
        tok.apply_default("tokenizer_model", origin)
        logger.info("tokenizer: the Hugging Face tokenizer in %s", origin)


def check_pretrained(cfg: "ConfigContainer", problems: Problems) -> None:
    if not _starts_from_hf(cfg):
        return

    directory = cfg.checkpoint.pretrained_checkpoint
    reference = check_hf_directory(directory, problems.at(PATH), weights=False)
    if reference is None:
        return
    for name, mine, theirs in architecture_differences(cfg.model, reference):
        problems.add(
            f"model.{name}",
            f"{show(mine)}, but the Hugging Face model in {directory} has {show(theirs)}",
            f"build the model with GPTModelProvider.from_hf({directory!r}) (or set model.{name}={theirs!r})",
        )
    # Same shapes, other math (Llama 3.1's rope scaling in a Llama 3 recipe's model): refused unless
    # the field was set on purpose (a context extension, say), which is only logged.
    for name, mine, theirs in computation_differences(cfg.model, reference):
        message = f"{show(mine)}, but the Hugging Face model in {directory} has {show(theirs)}"
        if cfg.model.is_explicit(name):
            logger.warning("model.%s: %s; the run computes with the value set", name, message)
            continue
        problems.add(
            f"model.{name}",
            message,
            f"build the model from it (mbridge: --recipe-arg pretrained={directory}; Python: "
            f"GPTModelProvider.from_hf({directory!r})), or set model.{name} to choose the value",
        )
    if cfg.model.seq_length > reference.seq_length:
        logger.warning(
            "model.seq_length %d is beyond the %d positions of the Hugging Face model in %s: the model never saw "
            "positions past them (set model.seq_length and dataset.seq_length to at most %d, unless you extend "
            "its context on purpose)", cfg.model.seq_length, reference.seq_length, directory, reference.seq_length,
        )  # fmt: skip


def pretrained_vocab_size(cfg: "ConfigContainer") -> Optional[int]:
    """The vocabulary size of the Hugging Face weights the run starts from, or None (no such
    directory, or one `check_pretrained` will report)."""
    if not _starts_from_hf(cfg):
        return None

    reference = check_hf_directory(cfg.checkpoint.pretrained_checkpoint, Problems(), weights=False)
    return None if reference is None else reference.vocab_size


def check_save_hf(cfg: "ConfigContainer", problems: Problems) -> None:
    if not cfg.checkpoint.save_hf:
        return

    family_of_provider(cfg.model, problems)


def preflight(cfg: "ConfigContainer") -> None:
    """Check the weight files of a run starting from a Hugging Face directory: every shard
    present and complete, every tensor there with the shape config.json implies. Raises one
    `ConfigValidationError` naming the files and tensors."""
    if not _starts_from_hf(cfg):
        return

    problems = Problems()
    check_hf_directory(cfg.checkpoint.pretrained_checkpoint, problems.at(PATH), weights=True)
    problems.raise_if_any()
