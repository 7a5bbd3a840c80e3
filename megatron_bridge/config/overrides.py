"""Command-line overrides: parsed here (Hydra's grammar), `${...}` interpolations resolved
(`config.interpolation`), then applied with a YAML file by `config.apply`
(`process_config_with_overrides`).

    key=value      change an existing key
    +key=value     add a key that does not exist yet (inside dict-typed fields)
    ++key=value    add or change
    ~key[=value]   delete: a dataclass field goes back to its default; a dict key or list item is
                   removed (with `=value`, only if the current value is that)

Keys are dotted paths; list items are addressed by index (`logger.comet_tags.1=x`). Values read
like YAML/Hydra scalars: `5` int, `1e-4` float, `true` bool, `null` None, `'5'` string; `[a, b]`
a list and `{A: 1}` a dict (nested freely); `${...}` interpolations are kept for OmegaConf.
Unlike Hydra (where `a=1,2` is a multirun sweep), a bare comma-separated value is one string, so
`dataset.split=99,1,0` works unquoted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Iterable, Optional, Union

from megatron_bridge.config.apply import NO_VALUE, Applier, Override
from megatron_bridge.config.errors import ConfigValidationError, Problems, show
from megatron_bridge.config.interpolation import has_interpolation, resolve_interpolations
from megatron_bridge.config.serialization import load_yaml_file

_KEY_PART = re.compile(r"[A-Za-z0-9_\-]+")
_INT = re.compile(r"[-+]?\d(_?\d)*")
_FLOAT = re.compile(r"[-+]?((\d(_?\d)*\.\d*|\.\d+)([eE][-+]?\d+)?|\d(_?\d)*[eE][-+]?\d+|\.?inf|\.?nan)", re.IGNORECASE)

MAX_VALUE_LENGTH = 100_000
"""Longest override value accepted."""

MAX_DEPTH = 64
"""Deepest nesting of lists and dicts in an override value."""

def _short(text: str) -> str:
    return repr(text) if len(text) <= 80 else repr(text[:77]) + "..."


class OverrideSyntaxError(ValueError):
    """An override that does not follow the grammar; `.fix` says what to write instead."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


def parse_override(text: str) -> Override:
    """Parse one override string; raises OverrideSyntaxError."""
    if not isinstance(text, str):
        fix = "pass strings like 'train.train_iters=100'"
        raise OverrideSyntaxError(f"override {_short(text)} is not a string", fix)
    body = text.strip()
    op = "set"
    if body.startswith("++"):
        op, body = "force", body[2:]
    elif body.startswith("+"):
        op, body = "add", body[1:]
    elif body.startswith("~"):
        op, body = "delete", body[1:]
    key_text, eq, value_text = body.partition("=")
    key_text, fix = key_text.strip(), "write key=value, e.g. train.train_iters=100"
    if not eq and op != "delete":
        raise OverrideSyntaxError(f"override {_short(text)} has no '='", fix)
    if not key_text:
        raise OverrideSyntaxError(f"override {_short(text)} has an empty key", fix)
    key = tuple(key_text.split("."))
    bad = [p for p in key if not _KEY_PART.fullmatch(p)]
    if bad:
        raise OverrideSyntaxError(
            f"override {_short(text)}: {_short(key_text)} is not a dotted key",
            "use names and list indices joined by dots, e.g. a.b.0",
        )
    value = parse_value(value_text) if eq else NO_VALUE
    return Override(op, key, value, text)


def parse_value(text: str) -> Any:
    """Parse an override value (see the module docstring)."""
    stripped = text.strip()
    if not stripped:
        return ""
    if len(stripped) > MAX_VALUE_LENGTH:
        raise OverrideSyntaxError(
            f"value of {len(stripped):,} characters is over the {MAX_VALUE_LENGTH:,}-character limit",
            "put large values in a config file",
        )
    parser = _Parser(stripped)
    if stripped[0] in "[{'\"":
        value = parser.element()
        parser.skip_ws()
        if parser.pos != len(stripped):
            raise OverrideSyntaxError(
                f"unexpected text {stripped[parser.pos :]!r} after {stripped[: parser.pos]!r}", "quote the whole value"
            )
        return value
    return primitive(stripped)


def primitive(text: str) -> Any:
    """An unquoted scalar: null, bool, int, float, else the string itself (escapes removed)."""
    low = text.lower()
    if low == "null":
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            digits = sum(c.isdigit() for c in text)
            raise OverrideSyntaxError(
                f"an integer of {digits:,} digits is larger than any setting", "use a number of sensible size"
            ) from None
    if _FLOAT.fullmatch(text):
        return float(text.replace(".", "") if low.lstrip("+-").startswith((".inf", ".nan")) else text)
    return re.sub(r"\\(.)", r"\1", text) if "\\" in text and "${" not in text else text


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.depth = 0

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, chars: str) -> str:
        self.skip_ws()
        ch = self.peek()
        if not ch or ch not in chars:
            found = repr(ch) if ch else "the end"
            wanted = " or ".join(repr(c) for c in chars)
            raise OverrideSyntaxError(
                f"expected {wanted} at position {self.pos} of {_short(self.text)}, found {found}",
                "check the brackets and quotes of the value",
            )
        self.pos += 1
        return ch

    def element(self) -> Any:
        self.skip_ws()
        ch = self.peek()
        if ch in ("[", "{"):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise OverrideSyntaxError(f"value nests deeper than {MAX_DEPTH} levels", "flatten the value")
            self.pos += 1
            value = self.collection("]" if ch == "[" else "}")
            self.depth -= 1
            return value
        if ch and ch in "'\"":
            return self.quoted()
        if not ch:
            raise OverrideSyntaxError(f"{_short(self.text)} ends where a value should be", "complete the value")
        return primitive(self.bare())

    def collection(self, close: str) -> Any:
        """The list (`close` is `]`) or mapping (`}`) whose opening bracket was just read."""
        items: list = []
        self.skip_ws()
        if self.peek() == close:
            self.pos += 1
            return {} if close == "}" else items
        while True:
            items.append(self.entry() if close == "}" else self.element())
            if self.expect("," + close) == close:
                return dict(items) if close == "}" else items

    def entry(self) -> tuple[str, Any]:
        """`key: value` in a mapping."""
        self.skip_ws()
        key = self.quoted() if self.peek() and self.peek() in "'\"" else self.bare(stop=":,}")
        if not key:
            raise OverrideSyntaxError(f"empty key in {_short(self.text)}", "write {name: value}")
        self.expect(":")
        return key, self.element()

    def quoted(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        chars = []
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if ch == "\\" and self.pos + 1 < len(self.text) and self.text[self.pos + 1] in (quote, "\\"):
                chars.append(self.text[self.pos + 1])
                self.pos += 2
                continue
            if ch == quote:
                self.pos += 1
                return "".join(chars)
            chars.append(ch)
            self.pos += 1
        raise OverrideSyntaxError(f"unterminated quote in {_short(self.text)}", f"close the string with {quote}")

    def bare(self, stop: str = ",]}") -> str:
        """Unquoted text up to a delimiter, keeping `${...}` interpolations whole."""
        start, depth = self.pos, 0
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if ch == "\\" and self.pos + 1 < len(self.text):
                self.pos += 2
                continue
            if ch == "$" and self.text.startswith("${", self.pos):
                depth += 1
                self.pos += 2
                continue
            if ch == "}" and depth:
                depth -= 1
            elif not depth and ch in stop:
                break
            self.pos += 1
        return self.text[start : self.pos].strip()


def process_config_with_overrides(
    config: Any,
    config_filepath: Optional[Union[str, os.PathLike]] = None,
    cli_overrides: Optional[Iterable[str]] = None,
) -> Any:
    """Merge `config_filepath` (YAML) into `config`, then apply `cli_overrides` (Hydra grammar,
    see `config.overrides`); return `config`, updated in place. Does not finalize it."""
    problems = Problems()
    data: Any = None
    if config_filepath is not None:
        try:
            data = load_yaml_file(config_filepath)
        except ConfigValidationError as exc:
            problems.absorb(exc)
        if data is not None and not isinstance(data, Mapping):
            problems.add(
                "",
                f"{os.fspath(config_filepath)} holds {show(data)}, not a mapping of sections",
                "write key: value lines",
            )
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
        try:
            data, overrides = resolve_interpolations(config, data, overrides, applier.error, file_label)
        except RecursionError:  # OmegaConf recurses over nested interpolations
            problems.add("", "interpolations nest too deeply to resolve", "simplify the ${...} expressions")
            data, overrides = None, []
    if data:
        applier.merge(data, file_label)
    for override in overrides:
        applier.apply(override)
    problems.raise_if_any()
    return config
