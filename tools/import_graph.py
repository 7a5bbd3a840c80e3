"""The package's import graph, read from the source: layers, cycles and function-local imports.

    python tools/import_graph.py [--list]

Prints four counts, each of which a test in tests/test_config_layers.py holds down:
- imports that go up the layers (`LAYERS`: each top-level package of megatron_bridge, as found on
  disk, has a layer; an import may name its own layer or one below), at module level or inside
  functions;
- of those, imports of training/ from below it (models/, data/, peft/, planning/, inference/,
  runtime/, config/);
- module-level import cycles between modules of the package;
- imports of the project's own modules that sit inside functions.
With --list it prints each of them too.

An import names the module it loads: `import a.b` and `from a import b` (b a submodule) both
name `a.b`; `from a.b import name` names `a.b`. Imports under `if TYPE_CHECKING:` never run and are
left out.
"""
from __future__ import annotations

import ast
import pathlib
import sys
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
OWN = ("megatron_bridge", "recipes")  # the project's own top-level packages


@dataclass(frozen=True)
class Import:
    importer: str  # dotted name of the importing module
    imported: str  # dotted name of the module it loads
    line: int
    in_function: bool  # inside a def (runs when called, not when the module loads)


def modules(root: pathlib.Path = ROOT, packages: tuple[str, ...] = OWN) -> dict[str, pathlib.Path]:
    """Every module of the given packages, dotted name -> file (packages by their __init__.py)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool):
    """(import node, inside a function) for every import statement that can run."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _walk(ast.Module(body=[other], type_ignores=[]), in_function)
        else:
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _walk(child, inner)


def imports_of(name: str, path: pathlib.Path, known: dict[str, pathlib.Path], own: tuple[str, ...] = OWN) -> list[Import]:
    """The imports of the packages' own modules in one module."""
    is_package = path.name == "__init__.py"
    out = []
    for node, in_function in _walk(ast.parse(path.read_text(), str(path)), False):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the importing package, up level - 1
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            # `from package import module` loads the submodule; `from module import name` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in dict.fromkeys(targets):
            if target.split(".")[0] in own:
                out.append(Import(name, target, node.lineno, in_function))
    return out


def all_imports(root: pathlib.Path = ROOT, packages: tuple[str, ...] = OWN) -> list[Import]:
    """Every import of the packages' own modules, read from their files under `root`."""
    known = modules(root, packages)
    return [imp for name, path in known.items() for imp in imports_of(name, path, known, packages)]


def cycles(imports: list[Import]) -> list[list[str]]:
    """The module-level import cycles: each strongly connected group of two or more modules (or a
    module importing itself), as a list of module names."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.in_function:
            graph.setdefault(imp.importer, set()).add(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


LAYERS = (
    ("", "config", "extras", "warning_filters"),  # "": the package's __init__ (lazy names only)
    ("runtime",),
    ("models", "data", "peft", "planning"),
    ("inference",),
    ("training",),
    ("cli", "launch", "plotting", "__main__", "recipes"),
)
"""The design's layers, bottom up, by top-level package (or module) of megatron_bridge; `recipes`
is the top-level package of the recipe library."""


def top_level(module: str) -> str:
    """The top-level package of megatron_bridge a module belongs to ("" for the package itself)."""
    parts = module.split(".")
    return "recipes" if parts[0] == "recipes" else (parts[1] if len(parts) > 1 else "")


def layer_of(module: str) -> int:
    """The index in `LAYERS` of the layer `module` belongs to; KeyError for a package no layer names."""
    top = top_level(module)
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise KeyError(f"{module}: its package {top!r} is in no layer of LAYERS")


def unlayered(root: pathlib.Path = ROOT) -> list[str]:
    """Top-level packages and modules of megatron_bridge on disk that no layer names."""
    named = {n for names in LAYERS for n in names}
    return sorted({top_level(m) for m in modules(root)} - named)


def going_up(imports: list[Import]) -> list[Import]:
    """Imports of a module in a higher layer than the importer's."""
    return [imp for imp in imports if layer_of(imp.imported) > layer_of(imp.importer)]


def upward(imports: list[Import]) -> list[Import]:
    """Imports of training/ from the layers below it."""
    return [
        imp for imp in going_up(imports)
        if top_level(imp.imported) == "training" and layer_of(imp.importer) < layer_of("megatron_bridge.training")
    ]


def depends_on(imports: list[Import]) -> dict[str, set[str]]:
    """Each module -> every module it imports, directly or through others (by the imports given)."""
    direct: dict[str, set[str]] = {}
    for imp in imports:
        direct.setdefault(imp.importer, set()).add(imp.imported)
    closure: dict[str, set[str]] = {}
    for start in direct:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in direct.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        closure[start] = seen
    return closure


def function_local(imports: list[Import], package: str = "megatron_bridge") -> list[Import]:
    """Imports of our own modules inside functions of `package`."""
    return [imp for imp in imports if imp.in_function and in_package(imp.importer, package)]


def statements(imports: list[Import]) -> list[tuple[str, int]]:
    """(module, line) of each import statement (one statement may name several modules)."""
    return sorted({(imp.importer, imp.line) for imp in imports})


def depth(imports: list[Import]) -> dict[str, int]:
    """Each module -> the length of its longest chain of module-level imports of our modules (0:
    it imports none); a cycle is cut where it closes."""
    direct: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.in_function:
            direct.setdefault(imp.importer, set()).add(imp.imported)
    found: dict[str, int] = {}

    def visit(module: str, path: frozenset[str]) -> int:
        if module not in found:
            below = [visit(d, path | {module}) for d in direct.get(module, ()) if d not in path]
            found[module] = 1 + max(below) if below else 0
        return found[module]

    for module in sorted(direct):
        visit(module, frozenset())
    return found


def main(argv: list[str]) -> int:
    imports = all_imports()
    show = "--list" in argv
    up, loops, local = going_up(imports), cycles(imports), function_local(imports)
    missing = unlayered()
    if missing:
        print(f"packages in no layer (add them to LAYERS): {', '.join(missing)}")
    print(f"imports up the layers: {len(up)}")
    print(f"  of which into training/ from below it: {len(upward(imports))}")
    if show:
        for imp in up:
            print(f"  {imp.importer}:{imp.line} -> {imp.imported}{' (in a function)' if imp.in_function else ''}")
    print(f"module-level import cycles: {len(loops)}")
    if show:
        for group in loops:
            print("  " + " <-> ".join(group))
    print(f"function-local imports of the project's own modules: {len(statements(local))} statements "
          f"({len(local)} modules named)")
    if show:
        for imp in local:
            print(f"  {imp.importer}:{imp.line} -> {imp.imported}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
