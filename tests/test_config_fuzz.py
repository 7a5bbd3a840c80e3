"""Configs are data: a fuzz campaign of hostile and broken input.

Several hundred cases from a fixed seed: `_target_` names reached through every module the old
prefix allowlist admitted (torch, megatron.core, megatron_bridge, recipes), command-line
overrides, and YAML files. Every case must end in a `ConfigValidationError` that names its field
or file (or, for a name on the allowlist, decode to the registered object), quickly, in bounded
memory, and without running anything: an audit hook records process starts, file writes, code
execution and module imports while each case runs.
"""

import contextlib
import random
import resource
import sys
import time
import types

import pytest
import torch
import yaml

from megatron_bridge.cli.main import main as mbridge
from megatron_bridge.config import targets
from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.training.config import ConfigContainer, runtime_config_update
from megatron_bridge.config.overrides import process_config_with_overrides
from recipes import tiny_gpt_pretrain_config

SEED = 20261123
CASE_SECONDS = 5.0
MEMORY_BYTES = 1 << 30

# ---------------------------------------------------------------------- watching for side effects
_FORBIDDEN_EVENTS = {
    "os.system", "subprocess.Popen", "os.posix_spawn", "os.exec", "os.spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "os.remove", "os.unlink", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree",
    "shutil.copyfile", "exec", "ctypes.dlopen", "socket.connect", "pty.spawn",
}  # fmt: skip
_ALLOWED_IMPORTS = ("megatron_bridge.models.", "omegaconf", "antlr4", "yaml", "encodings")


class _Watch:
    active = False
    events: list = []


def _hook(event, args):
    if not _Watch.active:
        return
    if event in _FORBIDDEN_EVENTS:
        _Watch.events.append((event, repr(args)[:120]))
    elif event == "open" and len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
        _Watch.events.append((event, repr(args)[:120]))
    elif event == "import" and args[0] not in sys.modules and not str(args[0]).startswith(_ALLOWED_IMPORTS):
        _Watch.events.append((event, args[0]))


sys.addaudithook(_hook)


@contextlib.contextmanager
def watched():
    _Watch.events = []
    _Watch.active = True
    try:
        yield _Watch.events
    finally:
        _Watch.active = False


# ---------------------------------------------------------------------- case generators
def _module_names(module, rng, limit):
    names = [n for n in dir(module) if not n.startswith("__")]
    rng.shuffle(names)
    return [f"{module.__name__}.{n}" for n in names[:limit]]


def target_names(rng):
    import megatron.core
    import megatron.core.utils

    import megatron_bridge
    import megatron_bridge.config.targets as target_module
    import megatron_bridge.config.serialization as serialization
    import recipes

    names = [
        "torch.os.system", "torch.serialization.os.system", "torch.save", "torch.load",
        "megatron_bridge.config.serialization.register_target",
        "megatron_bridge.config.targets.register_target", "megatron_bridge.config.targets.importlib.import_module",
        "megatron_bridge.__main__.main", "builtins.eval", "os.system", "subprocess.run", "functools.partial",
        "torch.nn.functional.os.system", "recipes.os.system", "megatron.core.os.system",
    ]  # fmt: skip
    for module, limit in ((torch, 90), (torch.nn.functional, 30), (megatron.core, 40), (megatron.core.utils, 30),
                          (megatron_bridge, 20), (serialization, 20), (target_module, 20), (recipes, 20)):  # fmt: skip
        names += _module_names(module, rng, limit)
    return names


def target_cases(rng, tmp):
    """(description, kind, payload): a `_target_` placed where configs accept one."""
    marker = tmp / "PWNED"
    cases = []
    for name in target_names(rng):
        form = rng.choice(["call", "partial", "ref"])
        node = {"_target_": name, "_args_": [f"touch {marker}"]}
        if form == "partial":
            node["_partial_"] = True
        elif form == "ref":
            node = {"_target_": name, "_call_": False}
        where = rng.choice(["env_vars", "model.init_method", "dataset", "model.activation_func"])
        if where == "model.activation_func":
            cases.append((f"override activation_func={name}", "override", [f"model.activation_func={name}"]))
        elif where == "env_vars":
            cases.append((f"yaml env_vars {name} {form}", "yaml", {"env_vars": {"X": node}}))
        elif where == "dataset":
            cases.append((f"yaml dataset {name}", "yaml", {"dataset": {"_target_": name, "seq_length": 64}}))
        else:
            cases.append((f"yaml init_method {name} {form}", "yaml", {"model": {"init_method": node}}))
    return cases


_FIELDS = [
    "model.num_layers", "model.hidden_size", "model.hidden_dropout", "model.attention_dropout", "model.init_method_std",
    "optimizer.lr", "optimizer.adam_eps", "optimizer.weight_decay", "rng.seed", "train.train_iters",
    "train.global_batch_size", "train.micro_batch_size", "scheduler.lr_warmup_fraction", "scheduler.lr_warmup_iters",
    "train.exit_signal", "checkpoint.custom_manager_class", "model.params_dtype", "model.activation_func",
    "dataset.seq_length", "logger.log_interval", "validation.eval_iters", "model.tensor_model_parallel_size",
    "dataset.random_seed", "checkpoint.most_recent_k", "model.rotary_percent",
]  # fmt: skip
_BAD_VALUES = [
    "10**30", "1" + "0" * 40, "-1", "-0.5", "nan", "inf", "-inf", "1.5", "2", "4294967296", "-4294967297",
    "SIGKILL", "SIGSTOP", "os.system", "torch.os.system", "[1,2]", "{a: 1}", "null", "''", "abc", "true",
    "${train.train_iters}", "${oc.env:HOME}", "${nope}", "1e400", "0", "0x10", "{a:", "[", "'", "{", "[[[[",
    "\u202e\u0000", "é" * 50,
]  # fmt: skip


def override_cases(rng):
    cases = []
    for _ in range(200):
        field = rng.choice(_FIELDS + ["train.train_iter", "model.nope", "optimizer.learning_rate", "a..b", "x"])
        value = rng.choice(_BAD_VALUES)
        prefix = rng.choice(["", "", "+", "++", "~"])
        text = f"{prefix}{field}={value}" if prefix != "~" else f"~{field}"
        cases.append((f"override {text[:60]}", "override", [text]))
    for depth in (70, 5000, 50000):
        cases.append((f"override nested {depth}", "override", ["env_vars.X=" + "[" * depth + "]" * depth]))
    cases.append(("override long", "override", ["logger.wandb_project=" + "x" * 200_000]))
    cases.append(("override nested interpolation", "override", ["logger.wandb_project=" + "${" * 3000 + "x" + "}" * 3000]))
    cases.append(("data_parallel_size by hand", "override", ["data_parallel_size=4"]))
    return cases


def yaml_cases(rng):
    laughs = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
    )
    cases = [
        ("yaml billion laughs", "text", laughs),
        ("yaml 50k nested [", "text", "env_vars: " + "[" * 50000 + "]" * 50000),
        ("yaml 5k nested {", "text", "env_vars: " + "{a: " * 5000 + "1" + "}" * 5000),
        ("yaml recursive alias", "text", "env_vars: &a {X: *a}\n"),
        ("yaml recursive list", "text", "env_vars: {X: &b [1, *b]}\n"),
        ("yaml python tag", "text", "train: !!python/object/apply:os.system ['touch PWNED']\n"),
        ("yaml python name", "text", "model: {activation_func: !!python/name:os.system ''}\n"),
        ("yaml latin-1", "bytes", "train: {train_iters: 5}\nlogger: {wandb_project: 'caf\xe9'}\n".encode("latin-1")),
        ("yaml binary", "bytes", bytes(rng.randrange(256) for _ in range(4000))),
        ("yaml too large", "bytes", b"# padding\n" * 900_000),
        ("yaml not a mapping", "text", "- 1\n- 2\n"),
        ("yaml unknown section", "text", "trian: {train_iters: 5}\n"),
        ("yaml unknown key", "text", "train: {train_iter: 5}\n"),
        ("yaml huge int", "text", "model: {num_layers: " + "9" * 5000 + "}\n"),
        ("yaml nan", "text", "optimizer: {lr: .nan}\n"),
        ("yaml inf dropout", "text", "model: {hidden_dropout: .inf}\n"),
        ("yaml seed", "text", "rng: {seed: 4294967296}\n"),
        ("yaml signal", "text", "train: {exit_signal: SIGKILL}\n"),
        ("yaml tab", "text", "train:\n\ttrain_iters: 5\n"),
        ("yaml duplicate anchors", "text", "a: &x 1\nb: &x 2\ntrain: {train_iters: *x}\n"),
    ]
    dumped = tiny_gpt_pretrain_config().to_yaml()
    for i in range(60):  # a real config with random corruption
        chars = list(dumped)
        for _ in range(rng.randint(1, 6)):
            pos = rng.randrange(len(chars))
            chars[pos] = rng.choice(["{", "[", ":", "&a", "*a", "!!", "\t", "'", "%", "@", "- ", "\n  x", "9" * 30])
        cases.append((f"yaml corrupted {i}", "text", "".join(chars)))
    return cases


# ---------------------------------------------------------------------- running a case
def _only_registered(value, depth=0):
    """Every object in a decoded value is plain data, a config, or a registered object."""
    if depth > 50 or value is None or isinstance(value, (str, int, float, bool, torch.dtype)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_only_registered(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_only_registered(v, depth + 1) for v in value.values())
    if isinstance(value, type):
        return targets.is_registered(value)
    if isinstance(value, types.FunctionType) or callable(value) and not hasattr(value, "__dataclass_fields__"):
        import functools

        if isinstance(value, functools.partial):
            return targets.is_registered(value.func) and _only_registered(list(value.args) + list(value.keywords.values()))
        return targets.is_registered(value)
    if hasattr(value, "__dataclass_fields__"):
        return all(_only_registered(getattr(value, f), depth + 1) for f in value.__dataclass_fields__)
    return True


def write_case(kind, payload, tmp):
    """The config file of a file case (None for overrides)."""
    if kind == "override":
        return None
    path = tmp / "case.yaml"
    if kind == "yaml":
        path.write_text(yaml.safe_dump(payload))
    elif kind == "text":
        path.write_text(payload)
    else:
        path.write_bytes(payload)
    return path


def run_case(kind, payload, path, tmp):
    """'error: <first problem>' or 'ok'; anything else raises."""
    cfg = tiny_gpt_pretrain_config(dir=str(tmp / "runs"))
    try:
        if kind == "override":
            process_config_with_overrides(cfg, cli_overrides=payload)
        else:
            process_config_with_overrides(cfg, config_filepath=path)
        runtime_config_update(cfg, world_size=1)
        assert _only_registered(cfg)
        return "ok"
    except ConfigValidationError as exc:
        assert exc.errors, "an error with no problems"
        return "error: " + exc.errors[0]


@pytest.mark.timeout(300)
def test_fuzz_configs_never_run_code_and_always_end_in_a_config_error(tmp_path):
    rng = random.Random(SEED)
    cases = target_cases(rng, tmp_path) + override_cases(rng) + yaml_cases(rng)
    assert len(cases) >= 500
    # warm up: the first use of a code path imports its modules (their code runs then, not later)
    assert run_case("text", "", write_case("text", "train: {train_iters: 70}\n", tmp_path), tmp_path) == "ok"
    assert run_case("override", ["validation.eval_iters=${train.global_batch_size}"], None, tmp_path) == "ok"
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    outcomes = {"ok": 0, "error": 0}
    slow = []
    for description, kind, payload in cases:
        path = write_case(kind, payload, tmp_path)
        t0 = time.perf_counter()
        with watched() as events:
            outcome = run_case(kind, payload, path, tmp_path)
        took = time.perf_counter() - t0
        assert not events, (description, events)
        assert not (tmp_path / "PWNED").exists(), description
        if took > CASE_SECONDS:
            slow.append((description, took))
        if outcome == "ok":
            outcomes["ok"] += 1
            assert not description.startswith(("yaml billion", "yaml 50k", "yaml recursive", "yaml python", "yaml latin",
                                               "yaml too large", "override nested", "data_parallel")), description  # fmt: skip
        else:
            outcomes["error"] += 1
            message = outcome[len("error: ") :]
            named = message.split(":", 1)[0]
            assert named and named != "<config>" or "case.yaml" in message or "override" in message, (description, message)
            if kind in ("text", "bytes") and "case.yaml" not in message:
                # a file problem names the file; a value problem names the field and the file
                assert "." in named or named in {f.name for f in ConfigContainer.__dataclass_fields__.values()}, (description, message)
    total = time.perf_counter() - started
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start_rss
    print(f"{len(cases)} cases in {total:.1f} s: {outcomes}; peak RSS grew {grown / 2**20:.0f} MiB")
    assert not slow, slow
    assert grown < MEMORY_BYTES
    assert outcomes["error"] >= 450


@pytest.mark.timeout(120)
def test_hostile_configs_exit_2_from_the_cli_without_running_anything(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    cases = {
        "show": "env_vars:\n  X: {_target_: torch.os.system, _args_: ['touch %s']}\n" % marker,
        "laughs": "a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
        "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n",
        "deep": "env_vars: " + "[" * 50000 + "]" * 50000 + "\n",
        "doubling": "env_vars:\n  X0: abc\n" + "".join(f"  X{i}: ${{env_vars.X{i - 1}}}${{env_vars.X{i - 1}}}\n" for i in range(1, 60)),
    }
    benign = tmp_path / "benign.yaml"
    benign.write_text("train: {train_iters: 70}\nvalidation: {eval_iters: '${train.train_iters}'}\n")  # imports OmegaConf
    for argv in (["config", "show", str(benign)], ["pretrain", "--recipe", "tiny_gpt_pretrain_config", "--config-file", str(benign), "--dry-run"]):
        assert mbridge(argv) in (0, 2)  # warm up: the first use of a command imports its modules
    capsys.readouterr()
    for name, text in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        for argv in (["config", "show", str(path)], ["pretrain", "--recipe", "tiny_gpt_pretrain_config", "--config-file", str(path), "--dry-run"]):
            with watched() as events:
                code = mbridge(argv)
            err = capsys.readouterr().err
            assert code == 2, (argv, err)
            assert f"{name}.yaml" in err or "env_vars" in err, err
            assert "Traceback" not in err
            assert not events, events
    assert not marker.exists()
    code = mbridge(["pretrain", "--recipe", "tiny_gpt_pretrain_config", "--dry-run", "++env_vars.X={_target_: torch.os.system, _args_: [ls]}"])
    assert code == 2 and "'torch.os.system' is not a name configs may use" in capsys.readouterr().err
