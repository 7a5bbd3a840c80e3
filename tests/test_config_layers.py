"""The package's structure: layers that only go down, no import cycles, few imports hidden in
functions, no torch in the config machinery, and an override goes down the layers only.

The import graph is read from the source files on disk (tools/import_graph.py), so a new module
or package is checked as soon as it exists."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
try:
    import import_graph as graph
finally:
    sys.path.remove(str(ROOT / "tools"))

MAX_FUNCTION_LOCAL_IMPORTS = 60
"""Imports of our own modules inside functions (statements), across megatron_bridge. Those left
keep `mbridge --help`, the config layer, spawned workers and the checks that run before a model
loads (a wrong model source, a bad prompt file) free of torch and megatron-core, or break an
import cycle inside one package."""


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_import_reader_sees_each_way_of_importing_a_module(tmp_path):
    """`from package import module`, `import package.module`, relative imports and imports inside
    functions all name the module they load; `if TYPE_CHECKING:` imports never run."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "import pkg.c\n",
        "pkg/c.py": "from . import a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n",
        "pkg/d.py": "def f():\n    from pkg.a import name\n",
    })  # fmt: skip
    imports = graph.all_imports(tmp_path, packages=("pkg",))
    found = {(i.importer, i.imported, i.in_function) for i in imports}
    assert found == {
        ("pkg.a", "pkg.b", False),
        ("pkg.b", "pkg.c", False),
        ("pkg.c", "pkg.a", False),
        ("pkg.d", "pkg.a", True),
    }
    assert graph.cycles(imports) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert [(i.importer, i.line) for i in graph.function_local(imports, package="pkg")] == [("pkg.d", 2)]


def test_the_package_has_no_module_level_import_cycles():
    imports = graph.all_imports()
    assert len(imports) > 500  # the whole package was read
    assert graph.cycles(imports) == []


def test_every_package_has_a_layer_and_imports_go_down_the_layers_only():
    """Module level and inside functions alike: models/, data/, peft/, planning/ and inference/
    import nothing from training/, runtime/ nothing from those, config/ nothing above it."""
    assert graph.unlayered() == []
    up = [
        f"{i.importer}:{i.line} -> {i.imported}{' (in a function)' if i.in_function else ''}"
        for i in graph.going_up(graph.all_imports())
    ]
    assert up == []


def test_few_of_our_own_imports_hide_inside_functions():
    local = graph.statements(graph.function_local(graph.all_imports()))
    assert len(local) <= MAX_FUNCTION_LOCAL_IMPORTS, "\n".join(f"{m}:{line}" for m, line in local)


def test_an_override_from_the_command_line_goes_down_the_layers_only():
    """The layers are read from the package's module-level imports: a call goes up when the
    callee's module imports the caller's."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from trace_override import goes_up, trace
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert goes_up("megatron_bridge.config.annotations", "megatron_bridge.config.apply")  # apply imports it
    assert not goes_up("megatron_bridge.config.apply", "megatron_bridge.config.annotations")
    calls = trace(["optimizer.lr=3e-4"])
    pairs = [(caller, f"{mod}.{fn}") for caller, mod, fn, _ in calls]
    assert pairs[0] == ("megatron_bridge.cli.source", "megatron_bridge.config.overrides.process_config_with_overrides")
    callees = [callee for _, callee in pairs]
    assert "megatron_bridge.config.serialization.field" in callees  # the value is decoded by the schema
    assert ("megatron_bridge.config.apply", "megatron_bridge.config.base.__setattr__") in pairs  # and set on the section
    assert [c for c in calls if c[3]] == []


@pytest.mark.timeout(60)
def test_the_config_machinery_and_the_tokenizer_module_do_not_import_torch():
    # Spawned data-preprocessing workers import the tokenizer module; torch would cost each ~2 s.
    modules = ["annotations", "codec", "serialization", "apply", "overrides", "interpolation", "status"]
    code = (
        "import sys\n"
        + "".join(f"import megatron_bridge.config.{m}\n" for m in modules)
        + "import megatron_bridge.runtime.tokenizers.tokenizer\n"
        + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT)
    assert run.stdout.strip() == "[]"


def test_modules_moved_to_the_base_layer_keep_their_former_import_paths():
    moved = {
        "training.cpu_backend": "runtime.cpu_backend",
        "training.distributed": "runtime.distributed",
        "training.child_processes": "runtime.child_processes",
        "training.checkpointing.layout": "runtime.checkpointing.layout",
        "training.checkpointing.results_queue": "runtime.checkpointing.results_queue",
        "training.tokenizers.tokenizer": "runtime.tokenizers.tokenizer",
    }
    code = "; ".join(
        f"import megatron_bridge.{old} as a, megatron_bridge.{new} as b; assert a is b, '{old}'"
        for old, new in moved.items()
    )  # a fresh process: the old path must work before anything imported the new one
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
