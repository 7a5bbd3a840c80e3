"""Parsing JSON from files a user gives (config.json, tokenizer settings, data lines, safetensors
headers) so that every malformed input is a `json.JSONDecodeError`: Python's parser raises
RecursionError for arrays or objects nested past its recursion limit, which callers that report
malformed JSON would otherwise let through as a traceback, and bytes that are not UTF-8 raise
UnicodeDecodeError."""

from __future__ import annotations

import json
from typing import IO, Any, Union

TOO_DEEP = "arrays or objects nested too deeply"


def loads(text: Union[str, bytes, bytearray]) -> Any:
    """`json.loads`, with too deep nesting (at the start of `text`) and bytes that are not UTF-8
    (where they start) a `json.JSONDecodeError`."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError(TOO_DEEP, "", 0) from None
    except UnicodeDecodeError as exc:  # bytes that are not UTF-8 (JSON text is)
        raise json.JSONDecodeError(f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x})", "", exc.start) from None


def load(f: IO) -> Any:
    """`json.load`, with too deep nesting a `json.JSONDecodeError`."""
    return loads(f.read())
