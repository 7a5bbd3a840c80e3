"""The config a run saves with each checkpoint (`run_config.yaml` in an iteration directory), read
one way by everything that looks at a checkpoint: resuming, loading pretrained weights, PEFT,
conversions and inference.

`read_run_config(iteration_dir)` and `find_run_config(path, step)` return a `SavedRunConfig`:
the file's sections as plain data (`section`, `value`), what the run was (`with_peft`), and the
config objects themselves (`build`). The file is read by the hardened YAML reader
(`config.yaml_input`): depth, aliases and repeated keys are checked, and a broken file is a
`ConfigValidationError` naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.config.secrets import restore_environment
from megatron_bridge.config.serialization import from_dict
from megatron_bridge.config.yaml_input import load_file
from megatron_bridge.runtime.checkpointing.layout import RUN_CONFIG_FILE, resolve


@dataclass(frozen=True)
class SavedRunConfig:
    """A checkpoint's run config as it was written."""

    path: str
    """The run_config.yaml file."""
    data: dict[str, Any]
    """Its top-level mapping, as written (values read from the environment as `${oc.env:VAR}`)."""

    @property
    def directory(self) -> str:
        """The checkpoint iteration directory holding the file."""
        return os.path.dirname(self.path)

    def has_section(self, name: str) -> bool:
        return isinstance(self.data.get(name), dict)

    def section(self, name: str) -> dict[str, Any]:
        """Section `name` as plain data ({} when the file has none), each `${oc.env:VAR}` the run
        wrote for a value it read from the environment replaced by VAR's value here."""
        raw = self.data.get(name)
        return restore_environment(raw) if isinstance(raw, dict) else {}

    def value(self, section: str, name: str) -> Any:
        """`section.name` (see `section`); None when absent."""
        return self.section(section).get(name)

    @property
    def with_peft(self) -> bool:
        """Whether the run trained adapters (its checkpoints hold them, not full weights)."""
        return self.data.get("peft") is not None

    def build(self, section: Optional[str] = None, cls: Optional[type] = None) -> Any:
        """The config objects: the whole run config (the class its `_target_` names), or one
        `section` (as `cls`), decoded like any config file."""
        data = self.data if section is None else (self.data.get(section) or {})
        return from_dict(data, cls, f"file {self.path}")


def read_run_config(directory: str) -> Optional[SavedRunConfig]:
    """The run config saved in checkpoint iteration `directory`; None when there is none there. A
    file that is unreadable or not a mapping is a `ConfigValidationError` naming it."""
    path = os.path.join(directory, RUN_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    data = load_file(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigValidationError(
            ConfigProblem(path, f"holds a {type(data).__name__}, not the sections of a run config",
                          "point at a checkpoint written by megatron_bridge")  # fmt: skip
        )
    return SavedRunConfig(path, data)


def find_run_config(path: str, step: Optional[int] = None) -> Optional[SavedRunConfig]:
    """The run config of the checkpoint at `path` (a save directory, whose latest iteration or
    `step` is taken, or one `iter_*` directory); None when there is no checkpoint or no config."""
    try:
        directory, _ = resolve(path, step)
    except FileNotFoundError:
        return None
    return read_run_config(directory)
