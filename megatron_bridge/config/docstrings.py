"""Field docstrings: the string literal right after a field in a class body (an attribute
docstring), read with `ast` from the source of every class in the MRO, so megatron-core's own
field documentation shows for the fields our configs inherit."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap


@functools.lru_cache(maxsize=None)
def own_field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings written in the body of `cls` itself (not its bases)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # built-in, or defined where the source is not available
        return {}
    body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef)), [])
    return {
        stmt.target.id: inspect.cleandoc(after.value.value)
        for stmt, after in zip(body, body[1:])
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(stmt.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of `cls` and its bases; the most derived class that documents a field wins."""
    return {name: doc for klass in reversed(cls.__mro__) for name, doc in own_field_docs(klass).items()}
