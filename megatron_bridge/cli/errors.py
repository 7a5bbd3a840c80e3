"""Telling a user mistake (reported in one message, exit status 2) from a failure (traceback)."""

from __future__ import annotations

import contextlib
from typing import Iterator

EXIT_USAGE = 2
"""Exit status for a bad command line or config (as argparse uses for its own usage errors)."""


class UsageError(Exception):
    """A mistake in the command line or the config: printed without a traceback, exit status 2."""


# ConfigValidationError (and the recipe registry's UnknownRecipeError) are ValueErrors; a typed
# field refuses a wrong value with TypeError; a missing YAML file is FileNotFoundError.
CONFIG_ERRORS = (ValueError, TypeError, FileNotFoundError)


@contextlib.contextmanager
def config_errors_are_usage_errors(context: str = "") -> Iterator[None]:
    """Turn the errors that building or resolving a config raises for bad input into `UsageError`
    (chained, so `--debug` can show where they came from). Only wrap config handling with this:
    inside training the same exception types mean a bug."""
    try:
        yield
    except UsageError:
        raise
    except CONFIG_ERRORS as exc:
        message = str(exc) or type(exc).__name__
        raise UsageError(f"{context}{message}") from exc
