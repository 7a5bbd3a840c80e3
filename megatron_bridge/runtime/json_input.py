"""Parsing JSON from files a user gives (config.json, tokenizer settings, data lines, safetensors
headers) so that every malformed input is a `json.JSONDecodeError`: Python's parser raises
RecursionError for arrays or objects nested past its recursion limit, which callers that report
malformed JSON would otherwise let through as a traceback, and bytes that are not UTF-8 raise
UnicodeDecodeError."""

from __future__ import annotations

import json
from typing import IO, Any, Iterator, Union

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


def lines(path: str, error: type[ValueError], message: str = "{path} line {line}: not valid JSON ({msg}, column {col})") -> Iterator[tuple[int, Any]]:
    """(line number, value) of every non-blank line of JSON Lines file `path`; a line that is not
    JSON raises `error` with `message` filled in (`path`, `line`, and the parser's `msg`, `col`)."""
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is one that is not JSON
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = loads(line)
            except json.JSONDecodeError as exc:
                raise error(message.format(path=path, line=number, msg=exc.msg, col=exc.colno)) from None
            yield number, value
