"""Keeping secrets out of everything a config is written to or printed as.

Saved configs, tracker records, dry runs and logs get shared; credentials must not travel with
them. Every writer and printer of a config goes through `to_dict` (config.serialization), which
hands its output to `conceal`:

* A value read from the environment by a `${oc.env:VAR}` interpolation (in a config file, an
  override, a recipe option) is written back as `${oc.env:VAR}` wherever it appears in a string,
  also inside a longer one (`${oc.env:VAR}/runs`); loading the written config resolves it again
  in the environment of the loading process. Numbers and booleans are written as they are.
* A field or mapping key whose name marks a credential (`is_credential_name`: `comet_api_key`,
  `env_vars.HF_TOKEN`, `DB_PASSWORD`, ...) is written as `<redacted>` unless it came from the
  environment as above; `None` and empty values stay as they are.
* A password in a URL (`https://user:PASSWORD@host`) becomes `<redacted>`.

Keep credentials in the environment and name them with `${oc.env:VAR}`: the saved config then
still works, and holds only the variable's name. `printable` and `scrub` apply the same rules to
log lines and error messages; `restore_environment` resolves the `${oc.env:VAR}` of a written
config read as plain data (not through `from_dict`, which resolves every interpolation).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Iterable

REDACTED = "<redacted>"
"""What a credential is written as."""

MIN_EMBEDDED_LENGTH = 4
"""Shortest value from the environment that is also replaced inside longer strings (a shorter
one, say `1`, would turn up in unrelated text; where it is a whole value it is still replaced)."""

_SECRET_WORDS = frozenset({"password", "passwd", "passphrase", "secret", "secrets", "credential", "credentials",
                           "apikey", "privatekey"})  # fmt: skip
_SECRET_LAST_WORDS = frozenset({"token", "key", "pwd", "auth", "cookie"})
_VOCABULARY_TOKENS = frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask", "start", "end", "special",
                                "extra", "image", "audio", "video", "split", "num", "max"})  # fmt: skip
"""Words that make `..._token` a tokenizer's vocabulary entry (`pad_token`), not a credential."""

_WORDS = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
_ENV_READ = re.compile(r"\$\{\s*oc\.env\s*:\s*([^,}\s]+)")
_WRITTEN_ENV_READ = re.compile(r"\$\{oc\.env:([^,{}]+)\}")
_BOOKKEEPING = frozenset({"_target_", "_explicit_", "_implicit_", "_derived_"})
"""Keys of written configs that name classes and fields (`_target_`, `_explicit_`, ...)."""
_URL_PASSWORD = re.compile(r"(://[^/@:\s]+:)[^/@\s]+@")

_FROM_ENVIRONMENT: dict[str, str] = {}
"""Value read from the environment by a config interpolation -> the variable's name."""
_EMBEDDED: list[str] = []
"""The keys of `_FROM_ENVIRONMENT` replaced inside longer strings, longest first."""


@functools.lru_cache(maxsize=8192)  # the same field names come back with every config written
def is_credential_name(name: Any) -> bool:
    """Whether a field or key called `name` holds a credential: it has a word like password,
    secret, credential or apikey, or ends in token, key, pwd, auth or cookie (`comet_api_key`,
    `HF_TOKEN`; not `pad_token`, a tokenizer's vocabulary entry)."""
    if not isinstance(name, str):
        return False
    words = [w.lower() for w in _WORDS.split(name) if w]
    if not words:
        return False
    if any(w in _SECRET_WORDS for w in words):
        return True
    last = words[-1]
    if last not in _SECRET_LAST_WORDS:
        return False
    return not (last == "token" and len(words) > 1 and words[-2] in _VOCABULARY_TOKENS)


def remember_environment_reads(texts: Iterable[str]) -> None:
    """Record the values that the `${oc.env:VAR}` interpolations in `texts` read from the
    environment of this process, so that writers put the interpolation back in their place."""
    changed = False
    for text in texts:
        if "oc.env" not in text:
            continue
        for var in _ENV_READ.findall(text):
            value = os.environ.get(var)
            if value and _FROM_ENVIRONMENT.get(value) != var:
                _FROM_ENVIRONMENT[value] = var
                changed = True
    if changed:
        _update_embedded()


def _update_embedded() -> None:
    _EMBEDDED[:] = sorted((v for v in _FROM_ENVIRONMENT if len(v) >= MIN_EMBEDDED_LENGTH), key=len, reverse=True)


def _interpolation(value: str) -> str | None:
    """`${oc.env:VAR}` for a remembered `value` while VAR still holds it. A variable since unset
    or changed (a config built earlier in a long-lived process, a test's temporary environment)
    is forgotten: writing its name would make configs that no longer resolve here."""
    var = _FROM_ENVIRONMENT.get(value)
    if var is None:
        return None
    if os.environ.get(var) == value:
        return "${oc.env:" + var + "}"
    del _FROM_ENVIRONMENT[value]
    _update_embedded()
    return None


def scrub(text: str) -> str:
    """`text` with values read from the environment replaced by their interpolation and URL
    passwords redacted (for log lines and messages)."""
    whole = _interpolation(text)
    if whole is not None:
        return whole
    for value in list(_EMBEDDED):
        if value in text:
            written = _interpolation(value)
            if written is not None:
                text = text.replace(value, written)
    if "://" in text and "@" in text:
        text = _URL_PASSWORD.sub(r"\1" + REDACTED + "@", text)
    return text


def conceal(data: Any, name: Any = None) -> Any:
    """`to_dict` output (or any plain nested data) as it may be written or printed: see the
    module docstring. `name` is the field or key `data` is the value of."""
    credential = name is not None and is_credential_name(name)
    if isinstance(data, dict) and not (credential and data and "_target_" not in data):
        return {k: v if k in _BOOKKEEPING else conceal(v, k) for k, v in data.items()}
    if isinstance(data, str):
        text = scrub(data) if _FROM_ENVIRONMENT or "://" in data else data
        if text == data and data and credential and not _WRITTEN_ENV_READ.fullmatch(data):
            return REDACTED
        return text
    if credential and not (
        data is None or isinstance(data, bool) or (isinstance(data, (list, tuple, dict)) and not data)
    ):  # None, a flag or an empty container hides nothing
        return REDACTED
    if isinstance(data, (list, tuple)):
        return type(data)(conceal(v) for v in data)
    return data


def printable(name: Any, value: Any) -> str:
    """`repr(value)` of field or key `name` for a log line, with the rules of `conceal`."""
    shown = conceal(value, name)
    return shown if shown == REDACTED else repr(shown)


def restore_environment(data: Any) -> Any:
    """Plain data read from a written config with each `${oc.env:VAR}` replaced by the value of
    VAR in this process's environment (left as it is where VAR is unset)."""
    if isinstance(data, dict):
        return {k: restore_environment(v) for k, v in data.items()}
    if isinstance(data, list):
        return [restore_environment(v) for v in data]
    if isinstance(data, str) and "${oc.env:" in data:
        return _WRITTEN_ENV_READ.sub(lambda m: os.environ.get(m.group(1), m.group(0)), data)
    return data


def conceal_argv(argv: list[str]) -> list[str]:
    """A command line as it may be recorded (trackers in the training process record it): the
    value of each `KEY=VALUE` override whose key, or a key inside whose mapping value, names a
    credential is `<redacted>`, and values read from the environment are scrubbed."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        last = key.lstrip("+~").rsplit(".", 1)[-1]
        hidden = is_credential_name(last) and not _WRITTEN_ENV_READ.fullmatch(value) or _names_credential(value)
        if eq and key and not key.startswith("-") and hidden:
            arg = f"{key}={REDACTED}"
        out.append(scrub(arg))
    return out


def _names_credential(text: str) -> bool:
    """Whether override value `text` is a mapping with a credential-named key."""
    if "{" not in text:
        return False
    from megatron_bridge.config.overrides import OverrideSyntaxError, parse_value

    try:
        value = parse_value(text)
    except OverrideSyntaxError:
        return False
    return isinstance(value, dict) and conceal(value) != value
