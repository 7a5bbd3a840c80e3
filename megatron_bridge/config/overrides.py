"""Command-line overrides: parsed here (Hydra's grammar), `${...}` interpolations resolved
(`config.interpolation`), then applied with a YAML file by `config.apply`
(`process_config_with_overrides`).

    key=value      change an existing key
    +key=value     add a key that does not exist yet (inside dict-typed fields)
    ++key=value    add or change
    ~key[=value]   delete: a dataclass field goes back to its default; a dict key or list item is
                   removed (with `=value`, only if the current value is that)

Keys are dotted paths; list items are addressed by index (`logger.comet_tags.1=x`). Values are
read by the config file reader (`config.yaml_input.ValueLoader`: the same size, depth and alias
limits) as YAML flow values with Hydra's scalars: `5` int, `1e-4` float, `true` bool, `null`
None, `'5'` string (quotes follow YAML: `'it''s'`, `"tab\\t"`); `[a, b]` a list and `{A: 1}` or
`{A:1}` a dict (nested freely); `${...}` interpolations are kept whole for OmegaConf, also inside
lists and dicts. A value that does not start with a bracket or a quote is one scalar, read as
it is: unlike Hydra (where `a=1,2` is a multirun sweep), `dataset.split=99,1,0` is one string.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Iterable, Optional, Union

from megatron_bridge.config import yaml_input
from megatron_bridge.config.apply import NO_VALUE, Applier, Override
from megatron_bridge.config.errors import ConfigValidationError, Problems, show
from megatron_bridge.config.interpolation import has_interpolation, map_strings, resolve_interpolations

_KEY_PART = re.compile(r"[A-Za-z0-9_\-]+")

MAX_VALUE_LENGTH = 100_000
"""Longest override value accepted."""

_OPS = {"++": "force", "+": "add", "~": "delete", "": "set"}
"""Override prefix -> operation (longest prefix first)."""


class OverrideSyntaxError(ValueError):
    """An override that does not follow the grammar; `.fix` says what to write instead."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


def parse_override(text: str) -> Override:
    """Parse one override string; raises OverrideSyntaxError."""
    if not isinstance(text, str):
        fix = "pass strings like 'train.train_iters=100'"
        raise OverrideSyntaxError(f"override {show(text)} is not a string", fix)
    body = text.strip()
    prefix = next(p for p in _OPS if body.startswith(p))
    op, (key_text, eq, value_text) = _OPS[prefix], body[len(prefix) :].partition("=")
    key_text, fix = key_text.strip(), "write key=value, e.g. train.train_iters=100"
    if not eq and op != "delete":
        named = key_text and len(key_text) <= 200 and all(_KEY_PART.fullmatch(p) for p in key_text.split("."))
        raise OverrideSyntaxError(f"override {show(text)} has no '='", f"write {key_text}=VALUE" if named else fix)
    if not key_text:
        raise OverrideSyntaxError(f"override {show(text)} has an empty key", fix)
    key = tuple(key_text.split("."))
    if not all(_KEY_PART.fullmatch(p) for p in key):
        raise OverrideSyntaxError(
            f"override {show(text)}: {show(key_text)} is not a dotted key",
            "use names and list indices joined by dots, e.g. a.b.0",
        )
    value = parse_value(value_text) if eq else NO_VALUE
    return Override(op, key, value, text)


def parse_value(text: str) -> Any:
    """Parse an override value (see the module docstring)."""
    stripped = text.strip()
    if len(stripped) > MAX_VALUE_LENGTH:
        raise OverrideSyntaxError(
            f"value of {len(stripped):,} characters is over the {MAX_VALUE_LENGTH:,}-character limit",
            "put large values in a config file",
        )
    try:
        if not stripped.startswith(("[", "{", "'", '"')):
            return yaml_input.scalar(stripped)  # the whole text: `99,1,0` and `a: b` are strings
        protected, pieces = _protect_interpolations(stripped)
        value = yaml_input.parse(protected, "value", yaml_input.ValueLoader)
        return map_strings(value, lambda s: _PLACEHOLDER.sub(lambda m: pieces[int(m.group(1))], s)) if pieces else value
    except ConfigValidationError as exc:  # the reader's YAML error or limit, naming no file
        problem = exc.problems[0]
        yaml_error = problem.message.startswith("invalid YAML")
        fix = "check the brackets and quotes of the value" if yaml_error else problem.fix
        raise OverrideSyntaxError(problem.message, fix) from None
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        digits = sum(c.isdigit() for c in stripped)
        raise OverrideSyntaxError(
            f"an integer of {digits:,} digits is larger than any setting", "use a number of sensible size"
        ) from None


_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


def _protect_interpolations(text: str) -> tuple[str, list[str]]:
    """`text` with each `${...}` (nested ones inside it included) replaced by a placeholder that
    YAML reads as plain text, and the interpolations replaced (`map_strings` puts them back)."""
    if "\ue000" in text:
        raise OverrideSyntaxError("the value holds the private-use character U+E000", "remove it")
    out, pieces, i = [], [], 0
    while (start := text.find("${", i)) != -1:
        depth, end = 0, start
        while end < len(text):
            if text.startswith("${", end):
                depth, end = depth + 1, end + 2
                continue
            if text[end] == "}":
                depth -= 1
            end += 1
            if not depth:
                break
        out.append(text[i:start] + f"\ue000{len(pieces)}\ue001")
        pieces.append(text[start:end])
        i = end
    return "".join(out) + text[i:], pieces


def process_config_with_overrides(
    config: Any,
    config_filepath: Optional[Union[str, os.PathLike]] = None,
    cli_overrides: Optional[Iterable[str]] = None,
) -> Any:
    """Merge `config_filepath` (YAML) into `config`, then apply `cli_overrides` (Hydra grammar,
    see `config.overrides`); return `config`, updated in place. Does not finalize it."""
    if isinstance(cli_overrides, (str, bytes)):  # iterating it would make an override of each character
        raise TypeError(
            f"cli_overrides must be a list of override strings, got the {type(cli_overrides).__name__} "
            f"{show(str(cli_overrides))}; pass [{show(str(cli_overrides))}]"
        )
    problems = Problems()
    data: Any = None
    if config_filepath is not None:
        try:
            data = yaml_input.load_file(config_filepath)
        except ConfigValidationError as exc:
            problems.absorb(exc)
        if data is not None and not isinstance(data, Mapping):
            message = f"{os.fspath(config_filepath)} holds {show(data)}, not a mapping of sections"
            problems.add("", message, "write key: value lines")
            data = None
    overrides: list[Override] = []
    for text in cli_overrides or ():
        try:
            overrides.append(parse_override(text))
        except OverrideSyntaxError as exc:
            key = str(text).partition("=")[0].lstrip("+~").strip()
            where = key if key and all(part.isidentifier() or part.isdigit() for part in key.split(".")) else ""
            problems.add(where, f"{exc} [override {show(str(text))}]", exc.fix)
    # Whatever parsed is applied even when something did not, so every problem is reported at once.
    applier = Applier(config, problems)
    file_label = f"file {os.fspath(config_filepath)}" if config_filepath is not None else ""
    if has_interpolation(data, overrides):
        data, overrides = resolve_interpolations(config, data, overrides, problems, file_label)
    if data:
        applier.merge(data, file_label)
    for override in overrides:
        applier.apply(override)
    problems.raise_if_any()
    return config
