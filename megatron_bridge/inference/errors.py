"""The mistakes a user of `generate`/`evaluate` can make, each said in one message (the command
line prints them without a traceback). This module imports nothing heavy, so the command line
can tell them apart before torch or megatron-core load."""

from __future__ import annotations


class SourceError(ValueError):
    """A model source that cannot be used: missing, incomplete, or adapters without their base."""


class PromptError(ValueError):
    """A prompt that cannot be used: too long, empty, or needing an absent chat template."""


class DataError(ValueError):
    """Evaluation data that cannot be read or scored."""
