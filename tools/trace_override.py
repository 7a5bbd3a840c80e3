"""Which modules an override crosses on its way from the command line to the config field.

    python tools/trace_override.py [optimizer.lr=3e-4 ...]

Builds the tiny recipe's config as `mbridge` does and records every call between modules of
megatron_bridge from the CLI's call into the config layer until it returns; prints each distinct
(caller -> callee) pair with the layer of both, and flags a call from a lower layer up to a higher
one: a call into a module that imports the caller (the graph read from the source by
tools/import_graph.py). Each module is shown with its depth in the module-level import graph.
"""
import functools
import sys

import import_graph

_DEPENDS: dict[str, set[str]] = {}


def goes_up(caller: str, callee: str) -> bool:
    """A call goes up when the callee's module imports the caller's at module level (directly or
    through others): the lower module calls back into one built on it. The import graph is read
    from the source on disk (tools/import_graph.py); imports inside functions, which a test keeps
    few, are left out."""
    if not _DEPENDS:
        _DEPENDS.update(import_graph.depends_on([i for i in import_graph.all_imports() if not i.in_function]))
    return caller in _DEPENDS.get(callee, ())


@functools.cache
def _depths() -> dict[str, int]:
    return import_graph.depth(import_graph.all_imports())


def layer(module: str) -> int:
    """How many modules deep `module`'s module-level imports go (0: it imports none of ours)."""
    return _depths().get(module, 0)


def trace(overrides: list[str]) -> list[tuple[str, str, str, bool]]:
    """(caller module, callee module, callee function, goes up a layer) for each distinct call
    between modules while `overrides` are applied to the tiny recipe (after a warm-up run)."""
    from megatron_bridge.cli import source

    events = []
    recording = [False]
    entry = "process_config_with_overrides"

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        mod = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name == entry and mod == "megatron_bridge.config.overrides":
            recording[0] = event == "call"  # from the CLI's call into the config layer to its return
            if event == "return":
                return
        if event != "call" or not recording[0]:
            return
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        if mod.startswith("megatron_bridge") and mod != caller:
            events.append((caller, mod, frame.f_code.co_name))

    source.build_config(recipe="tiny_gpt_pretrain_config", overrides=list(overrides))  # warm caches
    sys.setprofile(profile)
    try:
        source.build_config(recipe="tiny_gpt_pretrain_config", overrides=list(overrides))
    finally:
        sys.setprofile(None)
    out, seen = [], set()
    for caller, mod, fn in events:
        if (caller, mod, fn) not in seen:
            seen.add((caller, mod, fn))
            out.append((caller, mod, fn, goes_up(caller, mod)))
    return out


def main() -> None:
    calls = trace(sys.argv[1:] or ["optimizer.lr=3e-4"])
    print("calls between modules while the override is handled (caller -> callee.function):")
    for caller, mod, fn, up in calls:
        print(f"  {caller} [{layer(caller)}] -> {mod}.{fn} [{layer(mod)}]{'   <-- UP' if up else ''}")
    print(f"{len(calls)} distinct cross-module calls, {sum(c[3] for c in calls)} of them up a layer")

if __name__ == "__main__":
    main()
