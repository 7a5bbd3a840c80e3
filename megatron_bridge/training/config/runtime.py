"""`runtime_config_update`: resolve everything a run derives, then validate, in a fixed order."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional

from megatron_bridge.config.base import finalize_into
from megatron_bridge.config.errors import ConfigValidationError, Problems

if TYPE_CHECKING:
    from megatron_bridge.training.config.container import ConfigContainer

logger = logging.getLogger(__name__)

_SCALARS = (str, int, float, bool)


def runtime_config_update(cfg: "ConfigContainer", world_size: Optional[int] = None) -> None:
    """Apply runtime updates, then validate; raise one `ConfigValidationError` for everything.

    1. set `cfg.env_vars` in the environment (existing variables win);
    2. resolve `cfg.mixed_precision` (a preset name or config) and apply it to model, optimizer
       and ddp, leaving fields the user set explicitly alone;
    3. compute `data_parallel_size` for `world_size` (default: the process group's, else
       WORLD_SIZE, else 1);
    4. finalize `cfg.comm_overlap` and apply it;
    5. `cfg.validate()`: finalize every section, cross-section checks, derived values.

    Calling it again gives the same result.
    """
    problems = Problems()
    apply_env_vars(cfg, problems)
    apply_mixed_precision(cfg, problems)
    cfg.set_data_parallel_size(world_size, problems)
    apply_comm_overlap(cfg, problems)
    cfg.validate_into(problems)
    problems.raise_if_any()


def apply_env_vars(cfg: "ConfigContainer", problems: Problems) -> None:
    p = problems.at("env_vars")
    if not isinstance(cfg.env_vars, dict):
        p.add("", f"must be a mapping of names to values, got {type(cfg.env_vars).__name__}", "use {NAME: value}")
        return
    for name, value in cfg.env_vars.items():
        if not isinstance(name, str) or not name.strip() or "=" in name:
            p.add(repr(name), "is not a valid environment variable name", "use a non-empty name without '='")
            continue
        if not isinstance(value, _SCALARS):
            p.add(name, f"value {value!r} is not a string or number", "give a scalar value")
            continue
        if name in os.environ and os.environ[name] != str(value):
            logger.info("env_vars.%s=%r not applied: the environment already has %r", name, value, os.environ[name])
        os.environ.setdefault(name, str(value))


def apply_mixed_precision(cfg: "ConfigContainer", problems: Problems) -> None:
    from megatron_bridge.training.mixed_precision import get_mixed_precision_config

    if cfg.mixed_precision is None:
        return
    name = cfg.mixed_precision if isinstance(cfg.mixed_precision, str) else "mixed_precision config"
    try:
        mp = get_mixed_precision_config(cfg.mixed_precision)
    except ConfigValidationError as exc:
        problems.absorb(exc)
        return
    cfg.apply_default("mixed_precision", mp)
    p = problems.at("mixed_precision")
    before = len(problems)
    finalize_into(mp, p)
    if len(problems) == before:
        mp.apply(cfg.model, cfg.optimizer, cfg.ddp, problems, name)


def apply_comm_overlap(cfg: "ConfigContainer", problems: Problems) -> None:
    if cfg.comm_overlap is None or cfg.data_parallel_size is None:
        return
    before = len(problems)
    finalize_into(cfg.comm_overlap, problems.at("comm_overlap"))
    if len(problems) == before:
        cfg.comm_overlap.apply(cfg.model, cfg.ddp, cfg.optimizer, problems)
