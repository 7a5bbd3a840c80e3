"""What the command line refuses, each case in a fresh process (warm registries hide bugs): names
configs may not use, on every route a config enters by; environment variables that load code;
values that would pass validation and then break the run; config files that are not files or
repeat a key; and secrets, which the printed configs must not show.

All cases start together when the first test of this module asks for one (a few processes at a
time), and each test checks its own case.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from factories import started

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "tiny_gpt_pretrain_config"
SECRET = "s3cr3t-Value-from-the-environment"
REFUSED_NAME = "is not a name configs may use"
PARALLEL = 3


def _env(**extra: str) -> dict:
    """The test's environment without launcher variables. PYTHONPATH stays: where the
    dependencies are installed beside the interpreter's (a GPU machine's carried wheels) only it
    finds them; the package itself is found as `python -m` in the repository."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def _mbridge(argv: list[str], cwd: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_bridge", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


def _tiny_yaml(**replace: str) -> str:
    """The tiny recipe's config as a complete YAML file, with top-level `key: value` lines replaced."""
    import recipes

    text = recipes.tiny_gpt_pretrain_config().to_yaml()
    for key, value in replace.items():
        assert f"\n{key}: {{}}\n" in text
        text = text.replace(f"\n{key}: {{}}\n", f"\n{key}:\n{value}\n")
    return text


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A directory for the cases' files (the repository stays the working directory)."""
    return tmp_path_factory.mktemp("refusals")


@pytest.fixture(scope="module")
def cases(work) -> Mapping[str, Future]:
    """Every case started (under pytest-xdist when first asked for: `factories.started`): name -> future
    of its CompletedProcess."""
    d = str(work)
    mark = {n: os.path.join(d, f"ran-{n}") for n in ("env", "kwargs", "merged", "show", "diff", "dry", "site")}
    # A file that merges over a recipe, and complete configs (for config show / diff) naming a refused target.
    with open(os.path.join(d, "merge.yaml"), "w") as fh:
        fh.write(f"env_vars:\n  X: {{_target_: pathlib.Path.touch, self: {mark['merged']}}}\n")
    for name in ("show", "diff"):
        with open(os.path.join(d, f"{name}.yaml"), "w") as fh:
            fh.write(_tiny_yaml(env_vars=f"  X: {{_target_: pathlib.Path.touch, self: {mark[name]}}}"))
    site = os.path.join(d, "site")
    os.makedirs(site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as fh:
        fh.write(f"open({mark['site']!r}, 'w').write('ran')\n")
    with open(os.path.join(d, "big.yaml"), "w") as fh:
        fh.write("env_vars:\n  BIG: " + "x" * (131072 - 4) + "\n")  # "BIG=" + value + NUL: one byte too many
    with open(os.path.join(d, "dup.yaml"), "w") as fh:
        fh.write("train:\n  train_iters: 5\noptimizer:\n  lr: 0.001\ntrain:\n  train_iters: 6\n")
    os.mkfifo(os.path.join(d, "fifo.yaml"))
    os.mkdir(os.path.join(d, "dir.yaml"))
    with open(os.path.join(d, "secret.yaml"), "w") as fh:
        fh.write(_tiny_yaml(env_vars="  API_TOKEN: ${oc.env:MB_TEST_SECRET}\n  HF_TOKEN: literal-credential"))
    a_file = os.path.join(d, "merge.yaml")
    long_name = os.path.join(d, "n" * 300, "checkpoints")
    fast = ["train.train_iters=2", "validation.eval_iters=0", "--dir", os.path.join(d, "runs")]
    argvs = {
        # ---- names configs may not use, on every route
        "env override": ["pretrain", "--recipe", TINY, *fast, f"++env_vars.X={{_target_: torch.os.system, command: touch {mark['env']}}}"],
        "kwargs override": ["pretrain", "--recipe", TINY, *fast,
                            f"++tokenizer.hf_tokenizer_kwargs.k={{_target_: pathlib.Path.write_text, self: {mark['kwargs']}, data: x}}"],
        "merged file": ["pretrain", "--recipe", TINY, *fast, "--config-file", a_file],
        "config show": ["config", "show", os.path.join(d, "show.yaml")],
        "config diff": ["config", "diff", TINY, os.path.join(d, "diff.yaml")],
        "dry run": ["pretrain", "--recipe", TINY, "--dry-run", f"model.init_method={{_target_: torch.os.system, command: touch {mark['dry']}}}"],
        # ---- environment variables
        "pythonpath run": ["pretrain", "--recipe", TINY, *fast, f"++env_vars.PYTHONPATH={site}"],
        "env refusals": ["pretrain", "--recipe", TINY, "--dry-run", "--config-file", os.path.join(d, "big.yaml"),
                         "++env_vars.LD_PRELOAD=/tmp/x.so", "++env_vars.BASH_ENV=/tmp/x.sh", "++env_vars.DYLD_INSERT_LIBRARIES=x"],
        # ---- values that broke the run
        "magnitudes and paths": ["pretrain", "--recipe", TINY, "--dry-run", "optimizer.lr=1e30",
                                 "optimizer.weight_decay=1e30", "optimizer.adam_eps=1e30", "optimizer.clip_grad=1e30",
                                 "model.init_method_std=1e30", "model.layernorm_epsilon=1e30", f"model.rotary_base={2**64}",
                                 "train.exit_duration_in_mins=1e30", "train.exit_interval=0",
                                 "logger.tensorboard_dir=", f"checkpoint.save={long_name}"],
        "load a file": ["pretrain", "--recipe", TINY, "train.train_iters=2", "--dir", os.path.join(d, "runs-load"),
                        f"checkpoint.load={a_file}"],
        "too large for host memory": ["pretrain", "--recipe", TINY, "train.train_iters=2", "--dir", os.path.join(d, "runs-memory"),
                                      "train.micro_batch_size=10000000", "train.global_batch_size=10000000",
                                      "dist.distributed_backend=gloo"],  # a CPU run on any machine
        "plan of a billion layers": ["pretrain", "--recipe", TINY, "--plan-only", "model.num_layers=1000000000"],
        "signal and empty save": ["pretrain", "--recipe", TINY, *fast, "train.exit_signal=SIGCHLD", "checkpoint.save="],
        "fifo config": ["pretrain", "--config-file", os.path.join(d, "fifo.yaml")],
        "directory config": ["config", "show", os.path.join(d, "dir.yaml")],
        "duplicate keys and a huge integer": ["pretrain", "--recipe", TINY, "--dry-run", "--config-file",
                                              os.path.join(d, "dup.yaml"), "train.train_iters=" + "9" * 5000],
        # ---- secrets are not printed
        "secret dry run": ["pretrain", "--recipe", TINY, "--dry-run", "+env_vars.API_TOKEN=${oc.env:MB_TEST_SECRET}",
                           "logger.comet_api_key=${oc.env:MB_TEST_SECRET}", "++env_vars.DB_PASSWORD=literal-credential"],
        "secret config show": ["config", "show", os.path.join(d, "secret.yaml")],
        "secret config diff": ["config", "diff", TINY, os.path.join(d, "secret.yaml")],
        "secret help": ["pretrain", "--recipe", TINY, "+env_vars.API_TOKEN=${oc.env:MB_TEST_SECRET}",
                        "++env_vars.DB_PASSWORD=literal-credential", "--help-config"],
    }  # fmt: skip
    envs = {name: _env(MB_TEST_SECRET=SECRET) for name in argvs}
    # a launcher variable exported empty (WORLD_SIZE=$SLURM_NTASKS outside an allocation)
    argvs["empty WORLD_SIZE"], envs["empty WORLD_SIZE"] = ["pretrain", "--recipe", TINY, *fast], _env(WORLD_SIZE="")
    marks: Future = Future()
    marks.set_result(mark)
    pool = ThreadPoolExecutor(PARALLEL)
    yield started([*argvs, "marks"], lambda name: marks if name == "marks" else pool.submit(_mbridge, argvs[name], REPO, envs[name]))
    pool.shutdown(wait=True)


def refused(cases, name: str, *messages: str) -> str:
    """The stderr of case `name`, after checking it exited 2 with `messages` and no traceback."""
    proc = cases[name].result()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for message in messages:
        assert message in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def nothing_ran(cases, *names: str) -> None:
    marks = cases["marks"].result()
    for name in names:
        assert not os.path.exists(marks[name]), f"{name}: the refused config ran code"


# ---------------------------------------------------------------------- refused names, every route
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "case, where, target, mark",
    [
        ("env override", "env_vars.X: ", "'torch.os.system' " + REFUSED_NAME, "env"),
        ("kwargs override", "tokenizer.hf_tokenizer_kwargs.k: ", "'pathlib.Path.write_text' " + REFUSED_NAME, "kwargs"),
        ("merged file", "env_vars.X: ", "'pathlib.Path.touch' " + REFUSED_NAME, "merged"),
        ("config show", "env_vars.X: ", "'pathlib.Path.touch' " + REFUSED_NAME, "show"),
        ("config diff", "env_vars.X: ", "'pathlib.Path.touch' " + REFUSED_NAME, "diff"),
        ("dry run", "model.init_method: ", "'torch.os.system' " + REFUSED_NAME, "dry"),
    ],
)
def test_a_refused_target_is_a_config_error_on_every_route(cases, case, where, target, mark):
    err = refused(cases, case, where, target, "register_target")
    assert "dictionary changed size" not in err
    nothing_ran(cases, mark)


# ---------------------------------------------------------------------- environment variables
@pytest.mark.timeout(600)
def test_env_vars_pythonpath_is_refused_and_its_sitecustomize_never_runs(cases):
    refused(
        cases, "pythonpath run",
        "env_vars.PYTHONPATH: may not be set from a config: Python imports modules from it",
        "(set it in the environment that launches the run, not in the config)",
    )  # fmt: skip
    nothing_ran(cases, "site")


@pytest.mark.timeout(600)
def test_env_vars_that_load_code_or_exceed_the_os_limit_are_refused(cases):
    refused(
        cases, "env refusals",
        "env_vars.LD_PRELOAD: may not be set from a config: the dynamic linker's settings",
        "env_vars.BASH_ENV: may not be set from a config: bash runs this file",
        "env_vars.DYLD_INSERT_LIBRARIES: may not be set from a config",
        "env_vars.BIG: NAME=value is 131,073 bytes, over the 131,072 bytes the operating system passes "
        "per environment variable (MAX_ARG_STRLEN)",
    )  # fmt: skip


# ---------------------------------------------------------------------- values that broke the run
@pytest.mark.timeout(600)
def test_an_empty_world_size_variable_is_named(cases, work):
    refused(
        cases, "empty WORLD_SIZE",
        "WORLD_SIZE: '' is not a whole number of at least 1 (launchers such as torchrun set it; unset it to run "
        "one process, or launch with torchrun)",
    )  # fmt: skip


@pytest.mark.timeout(600)
def test_a_5000_digit_integer_is_a_config_error(cases):
    refused(cases, "duplicate keys and a huge integer", "train.train_iters: an integer of 5,000 digits is larger than any setting")


@pytest.mark.timeout(600)
def test_absurd_magnitudes_exit_interval_0_and_bad_paths_are_refused_in_the_dry_run(cases):
    err = refused(
        cases, "magnitudes and paths",
        "optimizer.lr: 1e+30 is outside the allowed range [0, 10]",
        "optimizer.weight_decay: 1e+30 is outside the allowed range [0, 10]",
        "optimizer.adam_eps: 1e+30 is outside the allowed range (0, 1]",
        "optimizer.clip_grad: 1e+30 is outside the allowed range [0, 1000000]",
        "model.init_method_std: 1e+30 is outside the allowed range (0, 10]",
        "model.layernorm_epsilon: 1e+30 is outside the allowed range (0, 1]",
        f"model.rotary_base: {2**64} is outside the allowed range [1, 1000000000000]",
        "train.exit_duration_in_mins: 1e+30 is outside the allowed range (0, 5256000]",
        "train.exit_interval: 0 is outside the allowed range [1, 2**63)",
        "logger.tensorboard_dir: '' is not a path (give a path, or null to turn it off)",
        "checkpoint.save: the name 'nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn...' in it is 300 bytes, over the 255 bytes",
    )  # fmt: skip
    assert "11 configuration problems" in err


@pytest.mark.timeout(600)
def test_a_file_as_checkpoint_load_is_refused_before_training(cases, work):
    refused(cases, "load a file", f"checkpoint.load: {work}/merge.yaml is a regular file, not a checkpoint directory")
    assert not os.path.exists(work / "runs-load" / "tiny_gpt_pretrain" / "checkpoints" / "latest_checkpointed_iteration.txt")


@pytest.mark.timeout(600)
def test_an_exit_signal_that_is_no_stop_request_and_an_empty_save_stop_a_real_run_before_training(cases, work):
    refused(
        cases, "signal and empty save",
        "train.exit_signal: SIGCHLD is not a stop request",
        "(use one of SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGXCPU)",
        "checkpoint.save: '' is not a path",
    )  # fmt: skip
    assert not os.path.exists(work / "runs"), "the refused run wrote outputs"


@pytest.mark.timeout(600)
def test_a_cpu_run_too_large_for_this_machines_memory_is_refused_before_building(cases, work):
    err = refused(cases, "too large for host memory", "<config>: this CPU run needs about ", " GiB of memory per process (")
    assert "`--plan-only` shows where it goes; make the model, train.micro_batch_size or model.seq_length smaller" in err
    assert not os.path.exists(work / "runs-memory"), "the refused run wrote outputs"


@pytest.mark.timeout(600)
def test_a_plan_of_a_billion_layers_is_refused_not_built_layer_by_layer(cases):
    """--plan-only built per-layer tuples for a billion layers until MemoryError (a traceback)."""
    refused(cases, "plan of a billion layers", "mbridge: no plan: model.num_layers=1,000,000,000 is deeper than the "
            "planner models (at most 10,000 layers", "the planner cannot plan this config")


@pytest.mark.timeout(600)
def test_a_fifo_or_directory_as_config_file_is_named_for_what_it_is(cases, work):
    refused(cases, "fifo config", f"config file '{work}/fifo.yaml' is a FIFO (named pipe), not a YAML file")
    refused(cases, "directory config", f"config file '{work}/dir.yaml' is a directory, not a YAML file")


@pytest.mark.timeout(600)
def test_a_key_given_twice_in_a_yaml_file_names_the_key_and_both_lines(cases, work):
    refused(
        cases, "duplicate keys and a huge integer",
        f"{work}/dup.yaml, line 5: key 'train' is given twice in the same mapping (lines 1 and 5)",
    )  # fmt: skip


# ---------------------------------------------------------------------- secrets
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["secret dry run", "secret config show", "secret config diff", "secret help"])
def test_printed_configs_show_neither_environment_values_nor_credentials(cases, case):
    proc = cases[case].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert SECRET not in out and "literal-credential" not in out
    assert "${oc.env:MB_TEST_SECRET}" in out
    assert "<redacted>" in out
