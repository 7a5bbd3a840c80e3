"""One error type for every configuration problem, and the collector that builds it.

Checks never stop at the first problem: they add to a `Problems` collector, and the caller raises
one `ConfigValidationError` listing everything, each line as `<dotted.path>: <what> (<fix>)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from megatron_bridge.config.secrets import scrub
from megatron_bridge import extras

MAX_REPORTED = 100
"""Problems listed in an error message; the rest are counted ("and N more")."""


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config: where, what, and how to fix it."""

    path: str
    message: str
    fix: str = ""
    missing_module: str = ""
    """Set when the problem is an optional package that is not installed."""

    def __str__(self) -> str:
        where = self.path or "<config>"
        return f"{where}: {self.message} ({self.fix})" if self.fix else f"{where}: {self.message}"


class ConfigValidationError(ValueError):
    """Every problem found in a config, reported at once.

    `.errors` holds the formatted lines (one per problem), `.problems` the structured records.
    """

    def __init__(self, problems: list[ConfigProblem] | ConfigProblem | str):
        if isinstance(problems, str):
            problems = [ConfigProblem("", problems)]
        elif isinstance(problems, ConfigProblem):
            problems = [problems]
        self.problems: list[ConfigProblem] = list(problems)
        self.errors: list[str] = [str(p) for p in self.problems]
        count = len(self.errors)
        header = f"{count} configuration problem{'s' if count != 1 else ''}:"
        lines = [header, *(f"  - {e}" for e in self.errors[:MAX_REPORTED])]
        if count > MAX_REPORTED:
            lines.append(f"  ... and {count - MAX_REPORTED} more")
        super().__init__(scrub("\n".join(lines)))  # values read from the environment are not repeated

    def __reduce__(self):
        return (type(self), (self.problems,))


class RunStartError(Exception):
    """A run that could not start for a reason its config's validation cannot see (an experiment
    tracker without its credentials, say). Raised as a subclass that is also the original
    exception's type; its message says what to do, and the command line prints it without a
    traceback."""


class MissingPackageError(ConfigValidationError, ModuleNotFoundError):
    """A config asks for an optional package that is not installed (the message names the extra).

    It is both a `ConfigValidationError` (listing every other problem too) and a
    `ModuleNotFoundError`.
    """

    def __init__(self, problems: list[ConfigProblem]):
        ConfigValidationError.__init__(self, problems)
        self.name = next((p.missing_module for p in self.problems if p.missing_module), None)


def show(value: Any) -> str:
    """A short, unambiguous rendering of a value for error messages."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Problems:
    """Collects `ConfigProblem`s under a dotted path prefix.

    `problems.at("train")` returns a view that prefixes paths with `train.` and shares the list.
    """

    def __init__(self, prefix: str = "", items: list[ConfigProblem] | None = None):
        self.prefix = prefix
        self.items: list[ConfigProblem] = [] if items is None else items

    def at(self, name: str) -> "Problems":
        return Problems(self._join(name), self.items)

    def _join(self, name: str) -> str:
        if not name:
            return self.prefix
        return f"{self.prefix}.{name}" if self.prefix else name

    def add(self, path: str, message: str, fix: str = "", missing_module: str = "", source: str = "") -> None:
        """Add a problem at `path` below the prefix; a `source` (`file my.yaml`) is named after the message."""
        message = f"{message} [{source}]" if source else message
        self.items.append(ConfigProblem(self._join(path), message, fix, missing_module))

    def require_package(self, module: str, path: str, why: str) -> bool:
        """Add a problem if optional package `module` is not installed; return whether it is."""
        installed = extras.is_installed(module)
        if not installed:
            self.add(path, f"{why} needs the '{module}' package", extras.install_hint(module), module)
        return installed

    def check(self, ok: bool, path: str, message: str, fix: str = "") -> bool:
        """Add a problem unless `ok`; return `ok` so callers can skip dependent checks."""
        if not ok:
            self.add(path, message, fix)
        return ok

    def positive(self, path: str, value: Any, fix: str = "use 1 or more") -> bool:
        """`check` that `value` is > 0 ("must be positive"); None (unset) passes."""
        if value is None or value > 0:  # the message is built only when needed: this runs on every update
            return True
        self.add(path, f"must be positive, got {value}", fix)
        return False

    def absorb(self, error: ConfigValidationError) -> None:
        """Re-home the problems of an error raised by a nested finalize under this prefix."""
        for p in error.problems:
            self.add(p.path, p.message, p.fix, p.missing_module)

    def _owns(self, problem: ConfigProblem) -> bool:
        return not self.prefix or problem.path == self.prefix or problem.path.startswith(self.prefix + ".")

    def __bool__(self) -> bool:
        """True if there is a problem under this view's prefix."""
        return any(self._owns(p) for p in self.items)

    def __len__(self) -> int:
        """Number of problems collected so far (under any prefix: a position to compare against)."""
        return len(self.items)

    def __iter__(self) -> Iterator[ConfigProblem]:
        return (p for p in self.items if self._owns(p))

    def raise_if_any(self) -> None:
        if any(p.missing_module for p in self.items):
            raise MissingPackageError(self.items)
        if self.items:
            raise ConfigValidationError(self.items)
