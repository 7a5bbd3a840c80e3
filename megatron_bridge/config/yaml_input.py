"""Reading config files safely: bounded size, depth and alias expansion; errors that name the file.

Config files are shared, so a file is untrusted input. It is read as YAML's safe loader reads it
(no Python tags), in one pass over the parser's events that builds the data and checks:

* the file size (`MAX_BYTES`, 8 MiB by default; `MBRIDGE_MAX_CONFIG_BYTES` changes it);
* the nesting depth of mappings and lists (`MAX_DEPTH`): deep nesting would make the loader,
  and everything that walks the data, recurse without bound;
* the number of nodes once aliases are expanded (`MAX_NODES`): a few lines of anchors and
  aliases can stand for billions of nodes ("billion laughs");
* aliases to a node that contains them (recursive data).
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional, Union

import yaml

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.config.paths import file_kind

MAX_BYTES = 8 * 1024 * 1024
"""Largest config file read, in bytes, unless `MBRIDGE_MAX_CONFIG_BYTES` says otherwise."""


def max_bytes() -> int:
    """The size limit for config files: `MBRIDGE_MAX_CONFIG_BYTES` when set (read at each use, so
    a bad value is a message naming the variable, not an error importing this module)."""
    text = os.environ.get("MBRIDGE_MAX_CONFIG_BYTES", "").strip()
    if not text:
        return MAX_BYTES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise _error(
            "MBRIDGE_MAX_CONFIG_BYTES",
            f"{text[:40]!r} is not a positive whole number of bytes",
            f"set it to a size in bytes (the default is {MAX_BYTES}) or unset it",
        )
    return value

MAX_DEPTH = 64
"""Deepest nesting of mappings and lists."""

MAX_NODES = 200_000
"""Most nodes a file may describe, with every alias expanded."""

_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class YamlLoader(_Base):  # type: ignore[misc, valid-type]
    """Safe loader that reads `1e-4` as a float and leaves dates as strings."""


YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in entries if tag != "tag:yaml.org,2002:timestamp"]
    for first, entries in _Base.yaml_implicit_resolvers.items()
}


def read_exponent_floats(cls: type) -> None:
    """Make YAML loader or dumper class `cls` take `1e-4` (no dot) for a float, as YAML 1.2 does."""
    pattern = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
    cls.add_implicit_resolver("tag:yaml.org,2002:float", pattern, list("-+0123456789"))


read_exponent_floats(YamlLoader)


class ValueLoader(YamlLoader):  # type: ignore[misc, valid-type]
    """Reads one value as a command line writes it: YAML flow syntax (`[a, b]`, `{k: v}`, quotes),
    with plain scalars typed as Hydra types them. Only `true`/`false` (any case) are booleans and
    `null` is None; integers are decimal (`1_000`), floats include `1e-4`, `inf` and `.nan`;
    anything else (`yes`, `0x10`, `1:30`, `007`) is a string. Plain mapping keys are strings, and
    `{a:1}` (no space after the colon) means `{a: 1}`."""


ValueLoader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
    ("null", r"(?i:null)", "nN"),
    ("bool", r"(?i:true|false)", "tTfF"),
    ("int", r"[-+]?\d(?:_?\d)*", "-+0123456789"),
    ("float", r"[-+]?(?:(?:\d(?:_?\d)*\.\d*|\.\d+)(?:[eE][-+]?\d+)?|\d(?:_?\d)*[eE][-+]?\d+"
              r"|\.?(?i:inf|nan))", "-+0123456789.iInN"),
):  # fmt: skip
    ValueLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?:{_pattern})$"), list(_first))
ValueLoader.add_constructor(  # decimal, also with leading zeros (YAML 1.1 would read `017` as octal)
    "tag:yaml.org,2002:int", lambda loader, node: int(loader.construct_scalar(node).replace("_", ""))
)
_STR = "tag:yaml.org,2002:str"
_CONSTRUCTOR = yaml.constructor.SafeConstructor()
_SIMPLE = {f"tag:yaml.org,2002:{name}" for name in ("null", "bool", "int", "float")}
_INEXACT = object()
"""What `_typed` gives for a tag it leaves to `yaml.load` (a merge key `<<`, `!!set`, `!!binary`)."""


def _typed(text: str, loader: type, tag: Optional[str] = None) -> Any:
    """Scalar `text` as `yaml.load` with `loader` reads it: tagged `tag`, or plain (typed by the
    loader's resolvers)."""
    tag = tag or loader.resolve(loader, yaml.ScalarNode, text, (True, False))
    if tag == _STR:
        return text
    return loader.yaml_constructors[tag](_CONSTRUCTOR, yaml.ScalarNode(tag, text)) if tag in _SIMPLE else _INEXACT


def scalar(text: str) -> Any:
    """Plain scalar `text` typed as `ValueLoader` types it (the text itself unless it reads as
    null, a boolean or a number)."""
    return _typed(text, ValueLoader)


def _error(source: str, message: str, fix: str, line: int | None = None) -> ConfigValidationError:
    where = f"{source}, line {line}" if line is not None else source
    return ConfigValidationError(ConfigProblem(where, message, fix))


def load_file(path: Union[str, os.PathLike]) -> Any:
    """The data of config file `path`, read by `parse` (errors name the file). A file that is not a
    regular file, too large or not UTF-8 is refused as a `ConfigValidationError`; a missing one raises
    FileNotFoundError."""
    name = os.fspath(path)
    if not os.path.exists(name):
        raise FileNotFoundError(f"config file {name!r} does not exist")
    if not os.path.isfile(name):
        raise _error(name, f"is {file_kind(name)}, not a regular file", "give the path of a YAML file")
    size, limit = os.path.getsize(name), max_bytes()
    if size > limit:
        raise _error(
            name,
            f"is {size:,} bytes, over the {limit:,}-byte limit for config files",
            "configs are small; raise MBRIDGE_MAX_CONFIG_BYTES if this one really is meant to be this large",
        )
    try:
        with open(name, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise _error(name, f"cannot be read: {exc.strerror or exc}", "check the path and its permissions") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise _error(
            name,
            f"is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})",
            "save the file as UTF-8",
            line,
        ) from None
    return parse(text, name)


def parse(text: str, source: str = "<config>", loader: type = YamlLoader) -> Any:
    """The data in YAML `text`, as `yaml.load(text, Loader=loader)` reads it, after checking its
    depth, alias expansion, recursion and repeated keys; `source` names the text in errors."""
    try:
        data = _read(text, source, loader)
        return yaml.load(text, Loader=loader) if data is _INEXACT else data
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if getattr(exc, "context", None) == "while scanning a quoted scalar" and "end of stream" in problem:
            problem = "unterminated quote"
        line = mark.line + 1 if mark is not None else None
        raise _error(source, f"invalid YAML: {problem}", "fix the YAML syntax", line) from None
    except ConfigValidationError:  # a limit `_read` enforces
        raise
    except (ValueError, OverflowError) as exc:  # e.g. an integer of more digits than Python converts
        raise _error(source, f"holds a value that cannot be read: {str(exc)[:120]}", "fix the value") from None


class _Open:
    """A collection being read: its object, anchor and node count before it; for a mapping, the
    first mark of each key text, the key awaiting its value (`_NOTHING` when the next node is a
    key; `_ITEM` in a list) and whether that key is a plain `a:1` of a command-line value."""

    __slots__ = ("anchor", "data", "key", "marks", "start", "unspaced")

    def __init__(self, data: Any, anchor: Optional[str], start: int) -> None:
        self.data, self.anchor, self.start = data, anchor, start
        self.marks: dict[str, Any] = {}
        self.key: Any = _NOTHING if type(data) is dict else _ITEM
        self.unspaced = False


_NOTHING, _ITEM = object(), object()


def _read(text: str, source: str, loader: type) -> Any:
    """The data, built in the one pass over the parser's events that enforces the limits
    (iterative: no recursion, whatever the input); `_INEXACT` where `yaml.load` is to build it
    (explicit collection tags, merge keys, unhashable keys, repeated or unknown anchors, several
    documents: it reports those that are errors)."""
    typed: dict[str, Any] = {}  # plain scalar text -> its value
    anchors: dict[str, tuple[Any, Optional[int]]] = {}  # anchor -> (its object, expanded size; None while open)
    stack: list[_Open] = []
    root, nodes, documents, exact = None, 0, 0, True
    string_keys = loader is ValueLoader
    for event in yaml.parse(text, Loader=YamlLoader):
        kind = type(event)
        top = stack[-1] if stack else None
        at_key = top is not None and top.key is _NOTHING
        if kind is yaml.ScalarEvent:
            nodes += 1
            value = event.value
            if string_keys and at_key and not event.style:
                pass  # a plain key of a command-line mapping is its text, whatever YAML makes of it
            elif top is not None and top.unspaced and value == "" and not event.style:
                top.key, _, value = top.key.partition(":")  # `{a:1}`: YAML's key `a:1` without a value
                value = _typed(value, loader)
            elif event.tag is not None and event.tag != "!":
                value = _typed(value, loader, event.tag)
            elif event.implicit[0]:  # plain (or tagged `!`): typed by the loader's resolvers
                value = typed.get(value, _NOTHING)
                if value is _NOTHING:
                    value = typed[event.value] = _typed(event.value, loader)
            exact = exact and value is not _INEXACT
        elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
            nodes += 1
            value = {} if kind is yaml.MappingStartEvent else []
            exact = exact and event.tag in (None, "!")
            if len(stack) >= MAX_DEPTH:
                raise _error(source, f"nests deeper than {MAX_DEPTH} levels", "flatten the data", _line(event))
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            stack.pop()
            if top.anchor:
                anchors[top.anchor] = (top.data, nodes - top.start)
            continue
        elif kind is yaml.AliasEvent:
            value, size = anchors.get(event.anchor, (None, 1))
            if size is None:
                message = f"alias *{event.anchor} refers to a node that contains it"
                raise _error(source, message, "remove the recursion", _line(event))
            nodes += size
            exact = exact and event.anchor in anchors
        else:
            documents += kind is yaml.DocumentStartEvent
            continue
        if nodes > MAX_NODES:
            raise _error(
                source,
                f"expands to more than {MAX_NODES:,} values (counting every alias expanded)",
                "configs are small; write the values out instead of nesting aliases",
                _line(event),
            )
        anchor = None if kind is yaml.AliasEvent else event.anchor
        if anchor:
            exact = exact and anchor not in anchors
            anchors[anchor] = (value, 1 if kind is yaml.ScalarEvent else None)
        if top is None:
            root = value
        elif top.key is _ITEM:
            top.data.append(value)
        elif at_key:
            first = top.marks.setdefault(event.value, event.start_mark) if kind is yaml.ScalarEvent else None
            if first is not None and first is not event.start_mark and event.value != "<<":  # merge keys may repeat
                line = _line(event)  # a YAML loader would silently keep the last value
                message = f"key {event.value!r} is given twice in the same mapping (lines {first.line + 1} and {line})"
                raise _error(source, f"{message}; only one value can count", "keep one of them", line)
            top.unspaced = string_keys and kind is yaml.ScalarEvent and not event.style and ":" in value
            unhashable = type(value) is dict or type(value) is list
            exact = exact and not unhashable
            top.key = object() if unhashable else value
        else:
            top.data[top.key] = value
            top.key = _NOTHING
        if kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
            stack.append(_Open(value, anchor, nodes - 1))
    return root if exact and documents < 2 else _INEXACT


def _line(event: Any) -> int:
    return event.start_mark.line + 1
