"""The numbers a launcher (torchrun, Slurm's srun wrapper) passes in the environment: RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE. A value that is not a whole number in range is a
`ConfigValidationError` naming the variable, not a ValueError from deep inside a run."""

from __future__ import annotations

import os
from typing import Optional

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError

MINIMUM = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1, "TORCHELASTIC_RESTART_COUNT": 0, "MASTER_PORT": 1}
"""The smallest value each variable can have."""


def launcher_int(name: str, default: Optional[int] = None) -> int:
    """`int(os.environ[name])`, or `default` when unset (KeyError when there is no default).
    LOCAL_RANK=-1 counts as unset: the Hugging Face and DeepSpeed tools export it for "not
    launched as one of several processes"."""
    text = os.environ.get(name)
    if text is None or (name == "LOCAL_RANK" and text.strip() == "-1"):
        if default is None:
            raise KeyError(name)
        return default
    minimum = MINIMUM.get(name, 0)
    stripped = text.strip()
    if not stripped.isdigit() or int(stripped) < minimum:
        raise ConfigValidationError(
            ConfigProblem(
                name,
                f"{text[:40]!r} is not a whole number of at least {minimum}",
                "launchers such as torchrun set it; unset it to run one process, or launch with torchrun",
            )
        )
    return int(stripped)
