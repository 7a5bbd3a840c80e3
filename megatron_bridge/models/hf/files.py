"""What a Hugging Face model directory holds, and where a checkpoint's Hugging Face origin is.

    <dir>/config.json                     the architecture
    <dir>/model.safetensors               the weights in one file, or
    <dir>/model.safetensors.index.json    {"weight_map": {tensor: file}} over several shards
    <dir>/tokenizer.json, ...             the tokenizer (optional)

Plain file handling only: no torch, no safetensors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Callable, Optional, Union

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.runtime import json_input
from megatron_bridge.runtime.checkpointing.layout import INCOMPLETE_SUFFIX, resolve
from megatron_bridge.runtime.checkpointing.run_config import read_run_config
from megatron_bridge.runtime.writable import unwritable_reason

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HF_ASSETS_DIR = "hf"
"""Inside an iteration directory of a megatron checkpoint imported from (or trained from) a
Hugging Face model: its config.json and tokenizer files, so an export can reproduce them."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
"""Tokenizer files copied along with the weights (whichever exist)."""

ORIGIN_FILES = ("generation_config.json",)
"""Files of the Hugging Face model a checkpoint came from, copied into its export."""


_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def written_by_export(name: str) -> bool:
    """Whether `name` is a file an export writes (weights, index, config, tokenizer, origin files)."""
    return name in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE, *TOKENIZER_FILES, *ORIGIN_FILES) or bool(_SHARD.fullmatch(name))


EXPORT_FIX = "give a new or empty directory: an export replaces the whole directory"


def check_replaceable(
    out_dir: str, ours: Callable[[str], bool], what: str, fix: str, staged_beside: bool = False
) -> None:
    """Refuse (`ConfigValidationError` naming `out_dir`, with `fix`) an output directory that
    holds entries `ours` does not accept, or symbolic links: the writer replaces what it writes,
    and would delete or hide anything else there (a directory of the user's, a checkpoint of
    other iterations). A missing or empty directory, or one an earlier such write left, is fine.
    So is only a place this user can write: `out_dir` (or where it would be created), and with
    `staged_beside` (the writer stages `out_dir` beside it, then renames it) the staging
    directory too (its name, one suffix longer, must fit the filesystem)."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigValidationError(ConfigProblem(out_dir, "exists and is not a directory", f"give a new directory for {what}"))
    targets = [out_dir.rstrip("/") + INCOMPLETE_SUFFIX] if staged_beside else []
    for target in targets + [out_dir]:
        why = unwritable_reason(target, create=False)
        if why:
            fix_place = f"give a directory this user can write, with names the filesystem can store, for {what}"
            raise ConfigValidationError(ConfigProblem(out_dir, why, fix_place))
    if not os.path.lexists(out_dir):
        return
    foreign = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(out_dir) if not ours(e.name) or e.is_symlink())
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigValidationError(
            ConfigProblem(out_dir, f"holds {shown}, which {what} does not write", fix)
        )


def is_hf_directory(path: Optional[str]) -> bool:
    """True if `path` is a directory with config.json and safetensors weights (a single file or
    an index; the shards themselves are checked before loading)."""
    if not path or not os.path.isdir(path):
        return False
    has_weights = os.path.isfile(os.path.join(path, INDEX_FILE)) or os.path.isfile(os.path.join(path, SINGLE_FILE))
    return has_weights and os.path.isfile(os.path.join(path, CONFIG_FILE))


def read_json(path: str) -> Any:
    """Parse a JSON file; a missing or malformed file is a ValueError naming it."""
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return json_input.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None


def config_path(path: str) -> str:
    """config.json of a directory, or `path` itself when it names a file."""
    return os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path


def has_tokenizer(directory: Optional[str]) -> bool:
    return bool(directory) and os.path.isfile(os.path.join(directory, "tokenizer.json"))


def copy_tokenizer_files(
    source: Union[None, str, dict[str, Any]], destination: str, names: tuple[str, ...] = TOKENIZER_FILES
) -> list[str]:
    """Copy the tokenizer files of `source` (a directory, or a tokenizer.json file) into
    `destination`, or write them when `source` gives them as {name: text or bytes}; returns the
    names written."""
    if not source:
        return []
    if isinstance(source, dict):
        for name, content in source.items():
            with open(os.path.join(destination, name), "wb" if isinstance(content, bytes) else "w") as f:
                f.write(content)
        return list(source)
    if os.path.isfile(source):
        shutil.copyfile(source, os.path.join(destination, "tokenizer.json"))
        return ["tokenizer.json"]
    copied = []
    for name in names:
        src = os.path.join(source, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(destination, name))
            copied.append(name)
    return copied


def copy_hf_assets(origin: Optional[str], checkpoint_dir: str) -> None:
    """Copy config.json, the tokenizer and `ORIGIN_FILES` of Hugging Face directory `origin` into
    `checkpoint_dir/hf/`, where `hf_origin` finds them; nothing when `origin` is None."""
    if not origin:
        return
    target = os.path.join(checkpoint_dir, HF_ASSETS_DIR)
    os.makedirs(target, exist_ok=True)
    shutil.copyfile(os.path.join(origin, CONFIG_FILE), os.path.join(target, CONFIG_FILE))
    copy_tokenizer_files(origin, target)
    copy_tokenizer_files(origin, target, ORIGIN_FILES)


def hf_origin(path: Optional[str], depth: int = 4) -> Optional[str]:
    """The Hugging Face directory whose config.json and tokenizer describe the weights at `path`:
    `path` itself if it is one; for a megatron checkpoint (parent or iter_* directory), the `hf/`
    assets saved in it, else the origin of the run's `checkpoint.pretrained_checkpoint`. None if
    there is none (a model trained from scratch)."""
    if not path or depth <= 0:
        return None
    if is_hf_directory(path):
        return path
    directory = _iteration_dir(path)
    if directory is None:
        return None
    assets = os.path.join(directory, HF_ASSETS_DIR)
    if os.path.isfile(os.path.join(assets, CONFIG_FILE)):
        return assets
    return hf_origin(run_config_value(directory, "checkpoint", "pretrained_checkpoint"), depth - 1)


def _iteration_dir(path: str) -> Optional[str]:
    try:
        return resolve(path)[0]
    except (FileNotFoundError, ValueError):
        return None


def run_config_value(directory: str, section: str, name: str) -> Any:
    """`section.name` of the run config saved in checkpoint iteration `directory`, a string (None
    if absent)."""
    saved = read_run_config(directory)
    value = saved.value(section, name) if saved is not None else None
    return value if isinstance(value, str) else None
