"""Reading config files safely: bounded size, depth and alias expansion; errors that name the file.

Config files are shared, so a file is untrusted input. It is parsed with YAML's safe loader (no
Python tags), and before anything is built from it, one pass over the parser's events checks:

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

MAX_BYTES = int(os.environ.get("MBRIDGE_MAX_CONFIG_BYTES", 8 * 1024 * 1024))
"""Largest config file read, in bytes."""

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
    anything else (`yes`, `0x10`, `1:30`, `007`) is a string. Mapping keys are strings, and
    `{a:1}` (no space after the colon) means `{a: 1}`."""

    def construct_document(self, node: Any) -> Any:
        _read_unspaced_keys(node)
        return super().construct_document(node)


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


def _read_unspaced_keys(node: Any) -> None:
    """Plain keys become strings, and `{a:1}`, which YAML reads as the key `a:1` without a value,
    becomes `{a: 1}`: the way a command line writes a mapping."""
    if isinstance(node, yaml.MappingNode):
        for i, (key, value) in enumerate(node.value):
            if isinstance(key, yaml.ScalarNode) and not key.style:  # plain: "" from the C parser, None otherwise
                key.tag = _STR
                empty = isinstance(value, yaml.ScalarNode) and not value.style and value.value == ""
                if empty and ":" in key.value:
                    name, _, text = key.value.partition(":")
                    key.value = name
                    node.value[i] = (key, yaml.ScalarNode(_value_tag(text), text))
    for child in node.value if isinstance(node, yaml.CollectionNode) else ():
        for n in child if isinstance(child, tuple) else (child,):
            _read_unspaced_keys(n)


def _value_tag(text: str) -> str:
    return ValueLoader.resolve(ValueLoader, yaml.ScalarNode, text, (True, False))


_CONSTRUCTOR = yaml.constructor.SafeConstructor()


def scalar(text: str) -> Any:
    """Plain scalar `text` typed as `ValueLoader` types it (the text itself unless it reads as
    null, a boolean or a number)."""
    tag = _value_tag(text)
    return text if tag == _STR else ValueLoader.yaml_constructors[tag](_CONSTRUCTOR, yaml.ScalarNode(tag, text))


def _error(source: str, message: str, fix: str, line: int | None = None) -> ConfigValidationError:
    where = f"{source}, line {line}" if line is not None else source
    return ConfigValidationError(ConfigProblem(where, message, fix))


def read_text(path: Union[str, os.PathLike]) -> str:
    """The text of config file `path`, refused (as a `ConfigValidationError` naming the file) if
    it is missing, not a regular file, too large, or not UTF-8."""
    name = os.fspath(path)
    if not os.path.exists(name):
        raise FileNotFoundError(f"config file {name!r} does not exist")
    if not os.path.isfile(name):
        raise _error(name, f"is {file_kind(name)}, not a regular file", "give the path of a YAML file")
    size = os.path.getsize(name)
    if size > MAX_BYTES:
        raise _error(
            name,
            f"is {size:,} bytes, over the {MAX_BYTES:,}-byte limit for config files",
            "configs are small; raise MBRIDGE_MAX_CONFIG_BYTES if this one really is meant to be this large",
        )
    try:
        with open(name, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise _error(name, f"cannot be read: {exc.strerror or exc}", "check the path and its permissions") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise _error(
            name,
            f"is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})",
            "save the file as UTF-8",
            line,
        ) from None


def parse(text: str, source: str = "<config>", loader: type = YamlLoader) -> Any:
    """The data in YAML `text`, after checking its depth, alias expansion and recursion;
    `source` names the text in errors."""
    # A command-line value (at most 100,000 characters) without aliases, mappings or deep nesting
    # cannot break a limit or repeat a key: its lists skip the event pass, half their reading time.
    if loader is not ValueLoader or "*" in text or "{" in text or text.count("[") > MAX_DEPTH:
        _check_structure(text, source)
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, source) from None
    except (ValueError, OverflowError) as exc:  # e.g. an integer of more digits than Python converts
        raise _error(source, f"holds a value that cannot be read: {str(exc)[:120]}", "fix the value") from None


def load_file(path: Union[str, os.PathLike]) -> Any:
    """`parse(read_text(path))`, errors naming the file."""
    return parse(read_text(path), os.fspath(path))


def _yaml_error(exc: yaml.YAMLError, source: str) -> ConfigValidationError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if getattr(exc, "context", None) == "while scanning a quoted scalar" and "end of stream" in problem:
        problem = "unterminated quote"
    line = mark.line + 1 if mark is not None else None
    return _error(source, f"invalid YAML: {problem}", "fix the YAML syntax", line)


class _Mapping:
    """An open mapping during the event pass: the line of each key seen, and whether the next
    node is a key."""

    __slots__ = ("lines", "at_key")

    def __init__(self) -> None:
        self.lines: dict[str, int] = {}
        self.at_key = True


def _check_structure(text: str, source: str) -> None:
    """One pass over the parser events (iterative: no recursion, whatever the input)."""
    nodes = 0
    open_anchors: dict[str, int] = {}  # anchor -> node count when it opened
    sizes: dict[str, int] = {}  # anchor -> expanded size of its node
    stack: list[Union[str, None]] = []  # the anchor of each open collection, innermost last
    mappings: list[Union[_Mapping, None]] = []  # each open collection: its keys if a mapping
    try:
        for event in yaml.parse(text, Loader=YamlLoader):
            line = event.start_mark.line + 1 if event.start_mark is not None else None
            parent = mappings[-1] if mappings else None
            if parent is not None and isinstance(event, yaml.NodeEvent):  # a key or a value of `parent`
                if parent.at_key and isinstance(event, yaml.ScalarEvent):
                    _check_new_key(parent, event.value, line, source)
                parent.at_key = not parent.at_key
            if isinstance(event, yaml.AliasEvent):
                anchor = event.anchor
                if anchor in open_anchors:
                    message = f"alias *{anchor} refers to a node that contains it"
                    raise _error(source, message, "remove the recursion", line)
                nodes += sizes.get(anchor, 1)
            elif isinstance(event, yaml.ScalarEvent):
                nodes += 1
                if event.anchor:
                    sizes[event.anchor] = 1
            elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                nodes += 1
                stack.append(event.anchor)
                mappings.append(_Mapping() if isinstance(event, yaml.MappingStartEvent) else None)
                if len(stack) > MAX_DEPTH:
                    raise _error(source, f"nests deeper than {MAX_DEPTH} levels", "flatten the data", line)
                if event.anchor:
                    open_anchors[event.anchor] = nodes - 1
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                anchor = stack.pop()
                mappings.pop()
                if anchor:
                    sizes[anchor] = nodes - open_anchors.pop(anchor)
            else:
                continue
            if nodes > MAX_NODES:
                raise _error(
                    source,
                    f"expands to more than {MAX_NODES:,} values (counting every alias expanded)",
                    "configs are small; write the values out instead of nesting aliases",
                    line,
                )
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, source) from None


def _check_new_key(mapping: _Mapping, key: str, line: Optional[int], source: str) -> None:
    """Refuse `key` if `mapping` already has it: YAML loaders silently keep the last value."""
    first = mapping.lines.get(key)
    if first is not None and key != "<<":  # merge keys may repeat
        raise _error(
            source,
            f"key {key!r} is given twice in the same mapping (lines {first} and {line}); only one value can count",
            "keep one of them",
            line,
        )
    mapping.lines[key] = line if line is not None else 0
