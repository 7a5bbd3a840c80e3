"""Which modules an override crosses on its way from the command line to the config field.

    python tools/trace_override.py [optimizer.lr=3e-4 ...]

Builds the tiny recipe's config as `mbridge` does and records every call between modules of
megatron_bridge from the CLI's call into the config layer until it returns; prints each distinct
(caller -> callee) pair with the layer of both, and flags a call from a lower layer up to a higher
one. The layers, top to bottom: the CLI, the override parser, interpolation, the one apply, the
field schema and section reader, the sections, the value codec and annotations, errors and names.
"""
import sys

LAYER = {  # the design's order, top to bottom
    "megatron_bridge.cli": 0,
    "megatron_bridge.config.overrides": 1,  # the override parser and its entry point
    "megatron_bridge.config.interpolation": 2,
    "megatron_bridge.config.apply": 3,  # the one apply
    "megatron_bridge.config.serialization": 4,  # the compiled field schema (ClassInfo) and section reader
    "megatron_bridge.config.base": 5,  # the section (ConfigBase)
    "megatron_bridge.training.config": 5,
    "megatron_bridge.config.codec": 6,  # field values to plain data and back
    "megatron_bridge.config.annotations": 6,  # what a field annotation allows
    "megatron_bridge.config.errors": 7,
    "megatron_bridge.config.targets": 7,
}


def layer(module):
    for prefix, n in sorted(LAYER.items(), key=lambda kv: -len(kv[0])):
        if module.startswith(prefix):
            return n
    return None


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
            a, b = layer(caller), layer(mod)
            out.append((caller, mod, fn, a is not None and b is not None and b < a))
    return out


def main() -> None:
    calls = trace(sys.argv[1:] or ["optimizer.lr=3e-4"])
    print("calls between modules while the override is handled (caller -> callee.function):")
    for caller, mod, fn, up in calls:
        print(f"  {caller} [{layer(caller)}] -> {mod}.{fn} [{layer(mod)}]{'   <-- UP' if up else ''}")
    print(f"{len(calls)} distinct cross-module calls, {sum(c[3] for c in calls)} of them up a layer")

if __name__ == "__main__":
    main()
