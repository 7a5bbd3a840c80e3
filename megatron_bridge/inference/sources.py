"""What a model source is, checked before anything is built.

A source is a Hugging Face model directory (recognized by its `config.json`) or a directory of
our checkpoints: a save directory (its latest iteration, or `step`) or one `iter_N` directory.
A checkpoint of a LoRA/DoRA run holds only adapters; its base is the checkpoint the run recorded
(or `base` when given). Everything here reads files only: no torch, no megatron-core, so a wrong
path is reported at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from megatron_bridge.inference.errors import SourceError
from megatron_bridge.runtime.checkpointing import layout
from megatron_bridge.runtime.checkpointing.layout import RUN_CONFIG_FILE
from megatron_bridge.runtime.checkpointing.safe_reading import UnsafeCheckpointError, load_common, read_metadata
from megatron_bridge.runtime import json_input

if TYPE_CHECKING:
    from megatron_bridge.runtime.checkpointing.run_config import SavedRunConfig

HF, CHECKPOINT, ADAPTERS = "hf", "checkpoint", "adapters"
CONFIG_FILE = "config.json"
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
HF_ASSETS_DIR = "hf"
"""Inside an imported checkpoint's iteration directory: the Hugging Face config and tokenizer."""

CHECKPOINT_FILES = (".metadata", "metadata.json", "common.pt")
"""Files every complete torch_dist checkpoint iteration directory holds (besides its shards)."""


@dataclass(frozen=True)
class ModelSource:
    """A checked model source."""

    path: str
    """As given."""

    kind: str
    """`hf`, `checkpoint` (complete weights of ours) or `adapters` (a LoRA/DoRA run's)."""

    directory: str
    """The Hugging Face directory, or the checkpoint's iteration directory."""

    iteration: Optional[int] = None
    """The checkpoint's iteration (None for a Hugging Face directory)."""

    base: Optional["ModelSource"] = None
    """For adapters: the weights they were trained on."""

    def describe(self) -> str:
        if self.kind == HF:
            return f"Hugging Face model {self.directory}"
        what = "adapters" if self.kind == ADAPTERS else "checkpoint"
        text = f"{what} {self.directory} (iteration {self.iteration})"
        return f"{text} on {self.base.describe()}" if self.base is not None else text

    @property
    def hf_assets(self) -> Optional[str]:
        """The directory with the config.json/tokenizer of the Hugging Face model the weights
        came from (the source itself, or the `hf/` assets an import saved), if any."""
        if self.kind == HF:
            return self.directory
        assets = os.path.join(self.directory, HF_ASSETS_DIR)
        if os.path.isfile(os.path.join(assets, CONFIG_FILE)):
            return assets
        return self.base.hf_assets if self.base is not None else None


def resolve(path: str, step: Optional[int] = None, base: Optional[str] = None) -> ModelSource:
    """The source at `path`, checked: a Hugging Face directory, or a complete checkpoint of ours
    (with its base when it holds adapters). Raises `SourceError` saying what is wrong."""
    if not os.path.exists(path):
        raise SourceError(f"{path!r} does not exist (give a Hugging Face model directory or a checkpoint directory)")
    if not os.path.isdir(path):
        raise SourceError(f"{path!r} is a file; a model source is a Hugging Face model directory or a checkpoint directory")
    if os.path.isfile(os.path.join(path, CONFIG_FILE)):
        if step is not None:
            raise SourceError(f"--step picks a checkpoint iteration, but {path!r} is a Hugging Face model directory")
        if not any(os.path.isfile(os.path.join(path, name)) for name in HF_WEIGHTS):
            raise SourceError(
                f"{path!r} has a config.json but no weights (model.safetensors or model.safetensors.index.json): "
                "the Hugging Face model is incomplete"
            )
        return ModelSource(path, HF, path)
    directory, iteration = _iteration(path, step)
    check_complete(directory)
    config = read_run_config(directory)
    if not config.with_peft:
        return ModelSource(path, CHECKPOINT, directory, iteration)
    return ModelSource(path, ADAPTERS, directory, iteration, base=_base_of(directory, config, base))


def _iteration(path: str, step: Optional[int]) -> tuple[str, int]:
    try:
        directory, iteration = layout.resolve(path, step)
    except (FileNotFoundError, ValueError) as exc:
        if step is not None and os.path.isdir(path):
            raise SourceError(
                f"--step {step}: {path!r} holds no checkpoint of iteration {step} (complete iterations: "
                f"{layout.complete_iterations(path)}; give one of them, or leave --step out for the latest)"
            ) from None
        unfinished = sorted(n for n in os.listdir(path) if n.startswith("iter_") and n.endswith(layout.INCOMPLETE_SUFFIX))
        if unfinished and step is None and layout.read_tracker(path) is None:
            raise SourceError(
                f"no complete checkpoint in {path!r}: only {', '.join(unfinished)}, a save that did not finish "
                "(a run still writing it, or one stopped while it did)"
            ) from None
        raise SourceError(f"{exc} (a model source is a Hugging Face directory with config.json, or a checkpoint directory)") from None
    if step is not None and iteration != step:  # an iter_N directory is that iteration whatever --step says
        raise SourceError(
            f"--step {step}: {path!r} is the checkpoint of iteration {iteration} (leave --step out, or give the "
            "directory that holds its iterations)"
        )
    return directory, iteration


def check_complete(directory: str) -> None:
    """Raise `SourceError` unless `directory` is a complete checkpoint iteration: its metadata,
    its run config, and every shard file its metadata names, at least as long as recorded."""
    missing = [name for name in (*CHECKPOINT_FILES, RUN_CONFIG_FILE) if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise SourceError(f"the checkpoint {directory!r} is incomplete: {', '.join(missing)} missing")
    try:
        metadata = read_metadata(directory)
        load_common(directory)
    except UnsafeCheckpointError as exc:  # torn, foreign, or naming code to run
        raise SourceError(f"the checkpoint {directory!r} cannot be used: {exc}") from None
    except OSError as exc:
        if not os.path.isdir(directory):  # a run still training, keeping its latest checkpoints only, removed it
            raise SourceError(
                f"the checkpoint {directory!r} was removed while it was read (a run still saving removes its older "
                "checkpoints: checkpoint.most_recent_k); run again for its latest one"
            ) from None
        raise SourceError(f"the checkpoint {directory!r} cannot be read: {exc}") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            raise SourceError(f"the checkpoint {directory!r} is incomplete: shard {name} is missing")
        if os.path.getsize(file) < size:
            raise SourceError(
                f"the checkpoint {directory!r} is incomplete: shard {name} has {os.path.getsize(file)} bytes, "
                f"its metadata needs {size}"
            )


def read_run_config(directory: str) -> "SavedRunConfig":
    """The run config saved in a checkpoint iteration directory; `SourceError` when it has none
    that describes a model."""
    from megatron_bridge.runtime.checkpointing import run_config

    try:
        saved = run_config.read_run_config(directory)
    except (OSError, ValueError) as exc:  # ValueError: ConfigValidationError, naming the file
        raise SourceError(f"the checkpoint {directory!r} has an unreadable {RUN_CONFIG_FILE} ({exc})") from None
    if saved is None:
        raise SourceError(f"the checkpoint {directory!r} has no {RUN_CONFIG_FILE}")
    if not saved.has_section("model"):
        raise SourceError(f"{saved.path} describes no model: the checkpoint was not written by megatron_bridge")
    return saved


def _base_of(directory: str, config: "SavedRunConfig", given: Optional[str]) -> ModelSource:
    """The base weights of the adapters in `directory`: `given`, else what the run recorded."""
    if given is not None:
        base = resolve(given)
        if base.kind == ADAPTERS:
            raise SourceError(f"--base {given!r} holds adapters too; the base is a complete model")
        from megatron_bridge.models.saved_architecture import base_mismatch  # megatron-core: only for --base

        mismatch = base_mismatch(config.section("model"), given)
        if mismatch:
            raise SourceError(f"--base {mismatch}")
        return base
    try:
        common = load_common(directory)
    except UnsafeCheckpointError as exc:
        raise SourceError(str(exc)) from None
    record = common.get("peft") or {}
    configured = config.value("checkpoint", "pretrained_checkpoint")
    candidates = [c for c in (record.get("pretrained_iteration_dir"), record.get("pretrained_checkpoint"), configured) if c]
    for candidate in candidates:
        if os.path.isdir(candidate):
            base = resolve(candidate)
            if base.kind != ADAPTERS:
                return base
    recorded = candidates[0] if candidates else None
    where = f"{recorded!r}, which is not there" if recorded else "no base recorded"
    raise SourceError(
        f"{directory!r} holds only the adapters of a {record.get('method', 'PEFT')} run, and their base model is "
        f"missing ({where}); give the base checkpoint or Hugging Face directory with --base DIR"
    )


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json_input.load(f)
    except (OSError, ValueError) as exc:
        raise SourceError(f"{path} cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise SourceError(f"{path} holds no JSON object")
    return data


def declared_seq_length(source: ModelSource) -> Optional[int]:
    """The sequence length the model was built for, read from its files (no model built)."""
    if source.kind == HF:
        value = read_json(os.path.join(source.directory, CONFIG_FILE)).get("max_position_embeddings", 4096)
        return int(value) if isinstance(value, int) else None  # 4096: what the conversion assumes
    value = read_run_config(source.directory).value("model", "seq_length")
    return int(value) if isinstance(value, int) else None
