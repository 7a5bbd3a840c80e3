"""Finding recipes for the command line: library names, `module.path:function` and
`path/to/file.py:function`, and the library's table read from its source without importing it
(importing a recipe imports megatron-core, which takes seconds; listing them should not)."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable, Optional

from megatron_bridge.cli.errors import UsageError, config_errors_are_usage_errors

RECIPES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "recipes")


def is_reference(spec: str) -> bool:
    """True for `module.path:function` or `file.py:function` (a library name has no colon)."""
    return ":" in spec


def load(spec: str) -> Callable[..., Any]:
    """The recipe function that `spec` names: a library recipe, `module.path:function` or
    `path/to/file.py:function`. Errors are `UsageError`s saying what was looked for."""
    if not is_reference(spec):
        import recipes

        with config_errors_are_usage_errors():
            return recipes.get_recipe(spec)
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise UsageError(f"--recipe {spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    module = _load_file(spec, where) if where.endswith(".py") or os.sep in where else _import(spec, where)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and n.endswith("_config"))
        hint = f"; functions ending in _config there: {', '.join(found)}" if found else ""
        raise UsageError(f"--recipe {spec!r}: {where} has no function {name!r}{hint}")
    return fn


def _import(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):  # the module itself, not one it imports
            raise UsageError(
                f"--recipe {spec!r}: no module {module_name!r} (is its package installed or on PYTHONPATH? "
                "a file is given as path/to/file.py:function)"
            ) from None
        raise


def _load_file(spec: str, path: str) -> Any:
    if not os.path.isfile(path):
        raise UsageError(f"--recipe {spec!r}: no file {path!r}")
    full = os.path.abspath(path)
    # A stable, unique module name: pickling and megatron-core's checkpoint writer find the module again.
    name = "mbridge_recipe_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    directory = os.path.dirname(full)
    if directory not in sys.path:  # the file's siblings import as they would when run as a script
        sys.path.insert(0, directory)
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def world_size_of(fn: Any, cfg: Any = None) -> Optional[int]:
    """The world size a recipe is laid out for: its `@recipe(world_size=...)`, else the one its
    config records (`dist.recipe_world_size`), else None."""
    size = getattr(fn, "world_size", None)
    if size is None and cfg is not None:
        size = cfg.dist.recipe_world_size
    return size


# ---------------------------------------------------------------------- the library, unimported
def library_rows(directory: str = RECIPES_DIR) -> list[tuple[str, int, str]]:
    """(name, world size, first docstring line) of every `@recipe(world_size=N, ...)` function in
    the library's source files, sorted by name; read with `ast`, nothing is imported."""
    rows = []
    for file in sorted(os.listdir(directory)):
        if not file.endswith(".py"):
            continue
        with open(os.path.join(directory, file), encoding="utf-8") as f:
            tree = ast.parse(f.read(), file)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                world = _recipe_world_size(deco)
                if world is not None:
                    doc = ast.get_docstring(node) or ""
                    rows.append((node.name, world, doc.splitlines()[0] if doc else ""))
    return sorted(rows)


def _recipe_world_size(deco: ast.expr) -> Optional[int]:
    if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Name) and deco.func.id == "recipe"):
        return None
    for kw in deco.keywords:
        if kw.arg == "world_size" and isinstance(kw.value, ast.Constant):
            return kw.value.value
    if deco.args and isinstance(deco.args[0], ast.Constant):
        return deco.args[0].value
    return None
