"""Moved to megatron_bridge.config.typecheck (temporary re-export)."""

from megatron_bridge.config.typecheck import *  # noqa: F401,F403
from megatron_bridge.config.typecheck import __dict__ as _moved

globals().update({k: v for k, v in _moved.items() if not k.startswith("__")})
