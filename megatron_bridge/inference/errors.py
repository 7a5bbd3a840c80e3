"""The mistakes a user of `generate`/`evaluate` can make, each said in one message (the command
line prints them without a traceback). This module imports nothing heavy, so the command line
can tell them apart before torch or megatron-core load."""

from __future__ import annotations

import json
from typing import Any, Iterator

from megatron_bridge.runtime import json_input


class SourceError(ValueError):
    """A model source that cannot be used: missing, incomplete, or adapters without their base."""


class PromptError(ValueError):
    """A prompt that cannot be used: too long, empty, or needing an absent chat template."""


class DataError(ValueError):
    """Evaluation data that cannot be read or scored."""


def json_lines(path: str, error: type[ValueError]) -> Iterator[tuple[str, Any]]:
    """(location `path:line`, value) of every non-empty line of a JSONL file; a line that is not
    JSON raises `error` naming its location."""
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is one that is not JSON
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                value = json_input.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{where}: not JSON ({exc.msg})") from None
            yield where, value
