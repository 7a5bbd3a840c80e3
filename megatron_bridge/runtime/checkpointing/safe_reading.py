"""Reading the pickled files of a checkpoint without running code from them.

torch.distributed.checkpoint writes `.metadata` with `pickle` and reads it back with a plain
`pickle.load`, which calls whatever the file names: a checkpoint directory from someone else
(downloaded, copied from a shared disk) could run any command on loading. `read_metadata` unpickles
it with only what such a file holds (the metadata dataclasses and enums of
torch.distributed.checkpoint, `torch.Size`, dtypes, plain containers) and raises
`UnsafeCheckpointError` naming anything else. `load_common` reads `common.pt` with torch's
weights-only unpickler and says the same of a file that names code. `check_pickled_files` does
both, and is called on every checkpoint of ours before megatron-core or torch load it.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import warnings
from typing import Any

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"

_CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
"""Modules whose dataclasses and enums a metadata file is made of."""

_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout from its name
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("builtins", "bytearray"),
}
"""Other names a metadata file may use."""


TRUSTED_SOURCE_FIX = "use a checkpoint from a source you trust, or save it again"


class UnsafeCheckpointError(ValueError):
    """A pickled checkpoint file that names something such a file never holds, or is not one."""

    def __init__(self, problem: str, fix: str = TRUSTED_SOURCE_FIX):
        super().__init__(f"{problem} ({fix})")
        self.problem, self.fix = problem, fix


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import importlib

        import torch

        if (module, name) in _NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module in _CLASS_MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def read_metadata(directory: str) -> Any:
    """The torch.distributed.checkpoint `Metadata` in `directory`/.metadata, unpickled with only
    the classes such a file holds; `UnsafeCheckpointError` for a file naming anything else, or
    one that is not a checkpoint's metadata. OSError when it cannot be read."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(directory, METADATA_FILE)
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"{path} is not loaded: {exc}, which the metadata of a checkpoint never holds, and loading it "
                "could run code from the file"
            ) from None
        except Exception as exc:  # torn or foreign files fail in whatever unpickling hits
            raise UnsafeCheckpointError(
                f"{path} cannot be read as checkpoint metadata ({type(exc).__name__}: {exc})",
                "the checkpoint is damaged or incomplete: load another one, or save it again",
            ) from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not checkpoint metadata")
    return metadata


def check_pickled_files(directory: str) -> None:
    """Raise `UnsafeCheckpointError` unless the pickled files of checkpoint iteration `directory`
    that it has (`.metadata`, `common.pt`) hold only what a checkpoint's do: call before loading
    it, so that a tampered checkpoint is refused in one message, before anything is built."""
    if os.path.isfile(os.path.join(directory, METADATA_FILE)):
        read_metadata(directory)
    if os.path.isfile(os.path.join(directory, COMMON_FILE)):
        load_common(directory)


def load_common(directory: str) -> dict:
    """The `common.pt` state of checkpoint iteration `directory` (megatron-core's
    `load_common_state_dict`, which unpickles weights only); `UnsafeCheckpointError` for a file
    that names anything else, or one that cannot be read (damaged), said in one line."""
    from megatron.core import dist_checkpointing

    try:
        with warnings.catch_warnings():  # torch's note on a foreign file's pickle protocol, before it refuses it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return dist_checkpointing.load_common_state_dict(directory)
    except pickle.UnpicklingError as exc:  # torch's weights-only refusal (its advice to drop it is unsafe)
        raise UnsafeCheckpointError(
            f"{os.path.join(directory, COMMON_FILE)} is not loaded: it holds more than tensors and plain data, "
            "and loading it could run code from the file"
        ) from None
    except (RuntimeError, EOFError) as exc:  # a torn or truncated file, in torch's zip reader or unpickler
        reason = str(exc).split(". ")[0] or "it ends too early"  # torch goes on about what may have corrupted it
        raise UnsafeCheckpointError(
            f"{os.path.join(directory, COMMON_FILE)} cannot be read ({reason})",
            "the checkpoint is damaged or incomplete: load another one, or save it again",
        ) from None
