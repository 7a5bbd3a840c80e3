"""The config layer's structure: no import cycles, no torch, and an override goes down the layers only."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module_imports(path: pathlib.Path) -> set[str]:
    """Modules of megatron_bridge imported at module level (not inside functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_bridge"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("megatron_bridge"))
    return out


def test_the_config_machinery_has_no_import_cycles():
    package = ROOT / "megatron_bridge" / "config"
    graph = {f"megatron_bridge.config.{p.stem}": _module_imports(p) for p in package.glob("*.py") if p.stem != "__init__"}
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    assert "megatron_bridge.config.annotations" in graph
    done: set[str] = set()

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, "import cycle: " + " -> ".join((*stack, module))
        if module in done:
            return
        for dep in graph[module]:
            visit(dep, (*stack, module))
        done.add(module)

    for module in graph:
        visit(module, ())
    # the machinery does not import the training sections at module level
    assert not any(d.startswith("megatron_bridge.training") for p in package.glob("*.py") for d in _module_imports(p))


def test_an_override_from_the_command_line_goes_down_the_layers_only():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from trace_override import trace
    finally:
        sys.path.remove(str(ROOT / "tools"))
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
        + "import megatron_bridge.training.tokenizers.tokenizer\n"
        + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT)
    assert run.stdout.strip() == "[]"
