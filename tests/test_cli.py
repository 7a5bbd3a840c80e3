"""The `mbridge` command line: subcommands, dry runs, config show/diff, --help-config, error
reports (exit status 2, no traceback), and one real training run through the CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

import recipes
from factories import source_tree_env
from megatron_bridge.cli.main import SUBCOMMANDS, _subcommand_module, main
from megatron_bridge.models import count_parameters

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "tiny_gpt_pretrain_config"


# ---------------------------------------------------------------------- helpers
def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run `mbridge argv` in this process; return (exit status, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli_process(*argv: str, cwd: str = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m megatron_bridge argv` in a fresh process."""
    env = source_tree_env()
    return subprocess.run(
        [sys.executable, "-m", "megatron_bridge", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def summary(out: str) -> dict[str, str]:
    """The dry-run summary lines (`# key: text`) after the YAML and before the plan, as key -> text."""
    lines = out.split("# ---- dry run of", 1)[1].split("# ---- plan", 1)[0].splitlines()[1:]
    return {k.lstrip("# ").strip(): v.strip() for k, v in (line.split(":", 1) for line in lines)}


def printed_config(out: str) -> dict:
    """The YAML a command printed (dry-run summary comments included: they are YAML comments)."""
    return yaml.safe_load(out)


def assert_usage_error(code: int, err: str, *messages: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    for message in messages:
        assert message in err, err


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


# ---------------------------------------------------------------------- help and dispatch
def test_top_level_help_lists_commands_without_importing_torch():
    code = (
        "import sys; from megatron_bridge.cli.main import main; rc = main(['--help']);"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'recipes'));"
        "print('RC', rc, 'HEAVY', heavy)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for command in ("recipes", "pretrain", "finetune", "config"):
        assert command in proc.stdout
    assert "RC 0 HEAVY []" in proc.stdout


def test_subcommand_help_lists_options(capsys):
    code, out, _ = cli(capsys, "pretrain", "--help")
    assert code == 0
    for option in ("--recipe", "--config-file", "--recipe-arg", "--dir", "--name", "--dry-run", "--world-size"):
        assert option in out
    assert "--help-config" in out and "--debug" in out and "KEY=VALUE" in out


def test_missing_subcommand_module_is_skipped_but_listed():
    assert "plot" in SUBCOMMANDS
    assert _subcommand_module("no_such_command") is None
    assert _subcommand_module("recipes") is not None


def test_recipes_lists_every_recipe_with_world_size_and_description(capsys):
    code, out, _ = cli(capsys, "recipes")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert sorted(lines) == recipes.list_recipes()
    for name, line in lines.items():
        fn = recipes.get_recipe(name)
        assert line.split()[1] == str(fn.world_size)
        assert fn.__doc__.strip().splitlines()[0] in line


# ---------------------------------------------------------------------- dry run
def test_dry_run_of_tiny_recipe_prints_resolved_yaml_and_summary(capsys):
    code, out, err = cli(capsys, "pretrain", "--recipe", TINY, "--dry-run")
    assert code == 0, err
    cfg = recipes.get_recipe(TINY)()
    gbs, mbs, seq = cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.model.seq_length
    s = summary(out)
    assert s["data-parallel size"].startswith("1 ")
    assert s["microbatches per step"].startswith(f"{gbs // mbs} ")
    assert s["parameters"].startswith(f"{count_parameters(cfg.model).total:,} ")
    assert s["tokens per step"].startswith(f"{gbs * seq:,} ")
    assert "lr_warmup_steps=" in s["scheduler steps"] and "in samples" in s["scheduler steps"]
    resolved = printed_config(out)
    assert resolved["data_parallel_size"] == 1
    assert f"# ---- dry run of {TINY} at world size 1 (the recipe's world size)" in out


def test_dry_run_shows_what_was_decided_for_the_user():
    """What building and resolving the config decided (a preset's settings, a warmup scaled to
    a short run, a deprecated name read as the new one) is shown as comments: before, it was
    logged with no handler and never seen (the deprecation warning went bare to stderr)."""
    out = cli_process("pretrain", "--recipe", TINY, "--dry-run", "train.train_iters=3", "train.eval_iters=4")
    assert out.returncode == 0, out.stderr[-2000:]
    notes = out.stdout.split("# ---- dry run of", 1)[1].split("# ---- plan", 1)[0]
    assert "# note: mixed_precision 'fp32' set model.pipeline_dtype=float32, ddp.grad_reduce_in_fp32=True\n" in notes
    assert (
        "# note: scheduler.lr_warmup_iters: the recipe's warmup of 10 iterations is not shorter than the 3-iteration "
        "decay; using 0 (a tenth of it). Set scheduler.lr_warmup_iters to choose.\n"
    ) in notes
    assert "# warning: train.eval_iters is deprecated: using it as validation.eval_iters=4\n" in notes
    assert printed_config(out.stdout)["validation"]["eval_iters"] == 4  # still a loadable config


def test_dry_run_of_gpu_recipe_uses_its_world_size(capsys):
    code, out, err = cli(capsys, "pretrain", "--recipe", "llama3_8b_pretrain", "--dry-run")
    assert code == 0, err
    s = summary(out)
    assert s["data-parallel size"] == "4  (world 8 / (TP 1 x PP 1 x CP 2))"
    assert s["microbatches per step"] == "128  (GBS 512 / (MBS 1 x DP 4))"
    assert s["parameters"] == "8,030,261,248 (8.03B)"
    assert s["tokens per step"] == "4,194,304  (GBS 512 x seq_length 8192)"
    assert s["scheduler steps"] == "lr_warmup_steps=1024000, lr_decay_steps=256000000  (in samples)"
    # Not adapted for CPU: the GPU recipe is checked as written.
    assert printed_config(out)["model"]["bf16"] is True


def test_parameter_counts_just_under_a_unit_print_in_the_next_unit():
    from megatron_bridge.cli.dry_run import human

    # Gemma 3 1B has 999,885,952 parameters: '1B', not '1e+03M'
    assert [human(n) for n in (999_885_952, 999_499, 999_500, 1_234_567, 8_030_261_248, 950, 0)] == [
        "1B", "999K", "1M", "1.23M", "8.03B", "950", "0"
    ]


def test_dry_run_with_world_size_and_moe_active_parameters(capsys):
    code, out, err = cli(capsys, "pretrain", "--recipe", "qwen3_30b_a3b_pretrain_config", "--dry-run", "--world-size", "64")
    assert code == 0, err
    s = summary(out)
    assert s["data-parallel size"] == "8  (world 64 / (TP 4 x PP 2 x CP 1))"
    assert s["microbatches per step"] == "64  (GBS 512 / (MBS 1 x DP 8))"
    assert "active per token 3,353,556,992" in s["parameters"]
    assert "world size 64 (--world-size)" in out


def test_overrides_config_file_and_recipe_options_are_applied(tmp_path, capsys):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("train:\n  train_iters: 11\noptimizer:\n  lr: 0.5\n  weight_decay: 0.01\n")
    code, out, err = cli(
        capsys,
        "pretrain",
        "--recipe", TINY,
        "--config-file", str(overlay),
        "--dir", str(tmp_path),
        "--name", "exp",
        "--recipe-arg", "global_batch_size=16",
        "--dry-run",
        "optimizer.lr=0.25",
        "logger.log_interval=3",
    )  # fmt: skip
    assert code == 0, err
    cfg = printed_config(out)
    assert cfg["train"]["train_iters"] == 11  # from the file
    assert cfg["optimizer"]["weight_decay"] == 0.01  # from the file
    assert cfg["optimizer"]["lr"] == 0.25  # the override wins over the file
    assert cfg["logger"]["log_interval"] == 3
    assert cfg["train"]["global_batch_size"] == 16  # recipe option
    assert cfg["checkpoint"]["save"] == str(tmp_path / "exp" / "checkpoints")
    assert cfg["logger"]["tensorboard_dir"] == str(tmp_path / "exp" / "tb_logs")


def test_overrides_after_options_are_collected(capsys):
    code, out, err = cli(capsys, "pretrain", "--recipe", TINY, "train.train_iters=90", "--dry-run", "optimizer.lr=0.5")
    assert code == 0, err
    cfg = printed_config(out)
    assert (cfg["train"]["train_iters"], cfg["optimizer"]["lr"]) == (90, 0.5)


def test_full_config_file_without_recipe(tmp_path, capsys, monkeypatch):
    path = tmp_path / "run.yaml"
    code, out, _ = cli(capsys, "config", "show", "llama3_8b_pretrain_config")
    assert code == 0
    path.write_text(out)
    monkeypatch.setenv("WORLD_SIZE", "16")  # a launcher's world size beats the one the file records (8)
    code, out, err = cli(capsys, "pretrain", "--config-file", str(path), "--dry-run", "optimizer.lr=1e-4")
    assert code == 0, err
    assert summary(out)["data-parallel size"].startswith("8 ")
    assert "world size 16 (WORLD_SIZE)" in out
    assert printed_config(out)["optimizer"]["lr"] == 1e-4


def test_finetune_dry_run(tmp_path, capsys):
    (tmp_path / "training.jsonl").write_text('{"input": "1 2 3", "output": "4 5"}\n')  # the dry run reads the data
    code, out, err = cli(
        capsys,
        "finetune",
        "--recipe", "tiny_gpt_finetune_config",
        "--recipe-arg", f"dataset_root={tmp_path}",
        "--recipe-arg", f"pretrained_checkpoint={tmp_path}",
        "--dry-run",
    )  # fmt: skip
    assert code == 0, err
    cfg = printed_config(out)
    assert cfg["dataset"]["dataset_root"] == str(tmp_path)
    assert cfg["checkpoint"]["pretrained_checkpoint"] == str(tmp_path)
    # its batches are padded to their longest sample: the step holds at most GBS x seq_length tokens
    assert summary(out)["tokens per step"] == "at most 512  (GBS 8 x seq_length 64); each batch is padded to its longest sample"


# ---------------------------------------------------------------------- errors
ERROR_CASES = {
    "unknown key": (["train.trian_iters=3"], ["train.trian_iters", "unknown key", "did you mean 'train_iters'"]),
    "wrong type": (["train.train_iters=abc"], ["train.train_iters", "expected int, got str 'abc'"]),
    "malformed override": (["train.train_iters"], ["override 'train.train_iters' has no '='"]),
    "unparsable value": (["model.num_layers=[1"], ["check the brackets"]),
    "gbs not divisible": (
        ["train.global_batch_size=7", "--dry-run"],
        ["does not resolve at world size 1", "train.global_batch_size: 7 is not divisible"],
    ),
    "unknown recipe option": (["--recipe-arg", "dri=x"], ["options of recipe", "did you mean 'dir'"]),
    "wrong recipe option type": (["--recipe-arg", "train_iters=x"], ["train_iters: expected int, got str 'x'"]),
    "world size without dry run": (["--world-size", "2"], ["--world-size only applies to --dry-run"]),
    "unknown help section": (["--help-config", "trian"], ["has no section or field 'trian'", "did you mean 'train'"]),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_config_errors_exit_2_with_the_report(case, capsys):
    args, messages = ERROR_CASES[case]
    code, out, err = cli(capsys, "pretrain", "--recipe", TINY, *args)
    assert_usage_error(code, err, "mbridge pretrain: error:", *messages)


def test_unknown_recipe_names_close_ones(capsys):
    code, _, err = cli(capsys, "pretrain", "--recipe", "tiny_gpt", "--dry-run")
    assert_usage_error(code, err, "unknown recipe 'tiny_gpt'", "did you mean tiny_gpt_pretrain_config")


def test_missing_config_file(tmp_path, capsys):
    missing = str(tmp_path / "nope.yaml")
    code, _, err = cli(capsys, "pretrain", "--config-file", missing, "--dry-run")
    assert_usage_error(code, err, f"config file {missing!r} does not exist")


def test_invalid_yaml_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1,\n")
    code, _, err = cli(capsys, "pretrain", "--recipe", TINY, "--config-file", str(bad), "--dry-run")
    assert_usage_error(code, err, "invalid YAML")


def test_no_config_source(capsys):
    code, _, err = cli(capsys, "pretrain", "--dry-run")
    assert_usage_error(code, err, "give --recipe NAME or --config-file")
    code, _, err = cli(capsys, "pretrain", "--config-file", "x.yaml", "--dir", "/tmp/x")
    assert_usage_error(code, err)


def test_recipe_options_need_a_recipe(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(recipes.get_recipe(TINY)().to_yaml())
    code, _, err = cli(capsys, "pretrain", "--config-file", str(path), "--dir", "/tmp/x")
    assert_usage_error(code, err, "recipe options (--recipe-arg, --dir, --name) need --recipe NAME")


def test_argparse_errors_exit_2(capsys):
    code, _, err = cli(capsys, "pretrain", "--recipe", TINY, "--dry-run", "--world-size", "0")
    assert_usage_error(code, err, "expected a positive integer, got '0'")
    code, _, err = cli(capsys, "pretrain", "--recipe", TINY, "--bogus")
    assert_usage_error(code, err, "unrecognized arguments: --bogus")


@pytest.mark.parametrize("where", ["after", "before"])
def test_debug_shows_the_traceback(where, capsys):
    args = ["pretrain", "--recipe", TINY, "train.trian_iters=3"]
    argv = [*args, "--debug"] if where == "after" else ["--debug", *args]
    code, _, err = cli(capsys, *argv)
    assert code == 2
    assert "Traceback" in err and "ConfigValidationError" in err
    assert "did you mean 'train_iters'" in err


def test_error_in_a_fresh_process_exits_2_without_traceback(tmp_path):
    missing = str(tmp_path / "run.yaml")
    proc = cli_process("pretrain", "--config-file", missing, "train.train_iters=3")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"mbridge pretrain: error: config file {missing!r} does not exist\n"


@pytest.mark.timeout(300)
def test_dry_run_resolves_for_the_gpus_it_plans_for():
    """TransformerEngine is taken as installed on the GPUs a dry run plans for, whatever this
    machine has: tensor-parallel overlap stays on, and the output says what it resolved for.
    `--no-te` resolves for local layers: the overlap is turned off, said once."""
    argv = ["pretrain", "--recipe", "llama3_8b_pretrain_config", "--recipe-arg", "tensor_model_parallel_size=2",
            "--recipe-arg", "sequence_parallel=true", "--recipe-arg", "tp_comm_overlap=true"]  # fmt: skip
    proc = cli_process(*argv, "--dry-run", timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "overlap turned off" not in proc.stderr
    assert printed_config(proc.stdout)["model"]["tp_comm_overlap"] is True
    resolved_for = summary(proc.stdout)["resolved for"]
    assert resolved_for.startswith("TransformerEngine layers on the H100 80GB GPUs")
    assert resolved_for.endswith("installed on this machine too)") or resolved_for.endswith(
        "where it is assumed installed (this machine has none); --no-te resolves for megatron-core's local layers"
    )

    proc = cli_process(*argv, "--plan-only", "--no-te", "--gpu", "h200-141gb", timeout=240)
    assert proc.returncode == 0, proc.stderr
    warning = "comm_overlap: tensor-parallel overlap turned off: TransformerEngine layers are not in use (TransformerEngine is not installed)"
    assert proc.stderr.count(warning) == 1, proc.stderr
    assert proc.stdout.rstrip().endswith(
        "(world size 8: the recipe's world size; resolved for megatron-core local layers "
        "(--no-te: TransformerEngine taken as not installed on the GPUs))"
    )


def test_python_dash_m_runs_the_cli():
    proc = cli_process("recipes")
    assert proc.returncode == 0, proc.stderr
    assert TINY in proc.stdout and "llama31_405b_pretrain_config" in proc.stdout


# ---------------------------------------------------------------------- config show / diff
def test_config_show_recipe_and_file(tmp_path, capsys):
    code, out, _ = cli(capsys, "config", "show", TINY, "train.train_iters=7")
    assert code == 0
    assert printed_config(out)["train"]["train_iters"] == 7
    path = tmp_path / "tiny.yaml"
    path.write_text(out)
    code, again, _ = cli(capsys, "config", "show", str(path))
    assert code == 0
    assert printed_config(again) == printed_config(out)


def test_config_diff_prints_changed_fields(tmp_path, capsys):
    base = recipes.get_recipe(TINY)()
    other = recipes.get_recipe(TINY)()
    other.train.train_iters = 7
    other.optimizer.lr = 0.5
    other.logger.tensorboard_dir = None
    path = tmp_path / "other.yaml"
    other.to_yaml(path)
    code, out, _ = cli(capsys, "config", "diff", TINY, str(path))
    assert code == 0
    assert out.splitlines() == [
        f"train.train_iters: {base.train.train_iters} -> 7",
        f"optimizer.lr: {base.optimizer.lr} -> 0.5",
        f"logger.tensorboard_dir: {base.logger.tensorboard_dir} -> null",
    ]


def test_config_diff_ignores_bookkeeping_and_shows_whole_sections(tmp_path, capsys):
    same = tmp_path / "same.yaml"
    recipes.get_recipe(TINY)().to_yaml(same)  # carries _explicit_ lists; the recipe has none
    code, out, err = cli(capsys, "config", "diff", str(same), TINY)
    assert (code, out) == (0, "")
    assert "no differences" in err
    code, out, _ = cli(capsys, "config", "diff", TINY, "llama3_8b_pretrain_config")
    assert "model._target_: megatron_bridge.models.TinyGPTModelProvider -> " in out
    assert "model.context_parallel_size: 1 -> 2" in out
    assert not any(key in out for key in ("_explicit_", "_implicit_", "_derived_"))


def test_config_errors_exit_2(tmp_path, capsys):
    code, _, err = cli(capsys, "config", "show", "no_such_recipe")
    assert_usage_error(code, err, "mbridge config show: error: unknown recipe 'no_such_recipe'")
    code, _, err = cli(capsys, "config", "diff", TINY, str(tmp_path / "missing.yaml"))
    assert_usage_error(code, err, "mbridge config diff: error: config file", "does not exist")


# ---------------------------------------------------------------------- --help-config
def test_help_config_section_shows_types_values_defaults_and_docs(capsys):
    code, out, _ = cli(capsys, "pretrain", "--recipe", TINY, "--help-config", "train")
    assert code == 0
    iters = recipes.get_recipe(TINY)().train.train_iters
    assert out.startswith("train (TrainingConfig):")
    assert f"  train_iters: Optional[int] = {iters}  (class default: None)\n" in out
    assert "      Number of optimizer steps to train for." in out


def test_help_config_shows_megatron_core_docstrings(capsys):
    code, out, _ = cli(capsys, "pretrain", "--recipe", "llama3_8b_pretrain", "--help-config", "model.recompute_granularity")
    assert code == 0
    assert out.startswith("  recompute_granularity: Optional[Literal['full', 'selective']] = None  (class default)")
    assert "Determines which type of activation recompute to use." in out  # from megatron-core's TransformerConfig
    code, out, _ = cli(capsys, "pretrain", "--recipe", "llama3_8b_pretrain", "--help-config", "optimizer.lr")
    assert out.startswith("  lr: Optional[float] = 0.0003  (class default: None)")
    assert "Initial learning rate." in out  # megatron-core's OptimizerConfig


def test_help_config_lists_sections_and_recipe_options(capsys):
    code, out, _ = cli(capsys, "pretrain", "--recipe", TINY, "--help-config")
    assert code == 0
    assert "  train " in out and "TrainingConfig" in out
    assert "None (FaultToleranceConfig)" in out
    assert "options" in out and "PretrainOptions" in out
    code, out, _ = cli(capsys, "pretrain", "--recipe", TINY, "--dir", "/data/runs", "--help-config", "options.dir")
    assert code == 0
    assert out.startswith("  dir: str = '/data/runs'  (class default: 'runs')")
    assert "Base output directory" in out


def test_help_config_of_a_null_section_shows_class_defaults(capsys):
    code, out, _ = cli(capsys, "pretrain", "--recipe", TINY, "--help-config", "ft")
    assert code == 0
    assert "ft is None" in out
    assert "  enable_ft_package: bool = False\n" in out


# ---------------------------------------------------------------------- a real run
@pytest.mark.timeout(300)
def test_real_training_run_through_the_cli(tmp_path):
    proc = cli_process(
        "pretrain",
        "--recipe", TINY,
        "--dir", str(tmp_path),
        "--name", "cli",
        "--recipe-arg", "lr_warmup_iters=1",
        "train.train_iters=4",
        "logger.log_interval=1",
        "validation.eval_iters=1",
        cwd=str(tmp_path),
        timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [line for line in proc.stdout.splitlines() if re.search(r"iteration \d/4 .*lm loss", line)]
    assert len(losses) == 4, proc.stdout
    run_dir = tmp_path / "cli"
    assert (run_dir / "checkpoints" / "iter_0000004").is_dir()
    expected = f"checkpoints: {run_dir / 'checkpoints'} | tensorboard: {run_dir / 'tb_logs'}"
    assert proc.stdout.strip().splitlines()[-1] == expected


# ---------------------------------------------------------------------- a run directory where a checkpoint or file goes
@pytest.mark.slow  # several fresh processes
@pytest.mark.timeout(400)
def test_a_run_directory_given_for_its_checkpoints_or_config_names_the_one_meant(tmp_path):
    """A newcomer names the run directory (`runs/NAME`) where its `checkpoints/` or a config file
    belongs: each command refuses with exit status 2 and names the path meant, and `checkpoint.load`
    does not quietly start from scratch. Also a field given in the wrong section; and loading the
    checkpoints themselves prints no warnings of the libraries' internals."""
    from concurrent.futures import ThreadPoolExecutor

    trained = cli_process("pretrain", "--recipe", TINY, "--dir", str(tmp_path), "--name", "run",
                          "train.train_iters=2", "validation.eval_iters=0", cwd=str(tmp_path), timeout=280)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    run, ckpts = str(tmp_path / "run"), str(tmp_path / "run" / "checkpoints")
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "training.jsonl").write_text('{"input": "5 6 7", "output": "8 9"}\n' * 16)
    argvs = {
        "pretrained": ["finetune", "--recipe", "tiny_gpt_finetune_config", "--dir", str(tmp_path), "--name", "ft",
                       "--recipe-arg", f"pretrained_checkpoint={run}", "--recipe-arg", f"dataset_root={sft}",
                       "train.train_iters=2"],
        "load": ["pretrain", "--recipe", TINY, "--dir", str(tmp_path), "--name", "resumed", f"checkpoint.load={run}",
                 "train.train_iters=4"],
        "generate": ["generate", run, "--prompt", "1 2"],
        "config file": ["pretrain", "--config-file", run, "--dry-run"],
        "wrong section": ["pretrain", "--recipe", TINY, "--dry-run", "model.train_iters=2", "lr=0.1"],
        "generate from the checkpoints": ["generate", ckpts, "--prompt", "1 2", "--max-new-tokens", "2"],
    }  # fmt: skip
    with ThreadPoolExecutor(3) as pool:
        procs = dict(zip(argvs, pool.map(lambda argv: cli_process(*argv, cwd=str(tmp_path), timeout=240), argvs.values())))
    expected = {
        "pretrained": [f"checkpoint.pretrained_checkpoint: no checkpoint in {run!r}", f"did you mean {ckpts!r}?"],
        "load": [f"checkpoint.load: {run!r} holds no checkpoint, so the run would start from scratch, but {ckpts!r} "
                 f"holds one (set checkpoint.load={ckpts} to resume from it"],
        "generate": [f"no checkpoint in {run!r}", f"did you mean {ckpts!r}? (it holds one)"],
        "config file": [f"config file {run!r} is a directory, not a YAML file; the config that run saved is "
                        f"{os.path.join(ckpts, 'iter_0000002', 'run_config.yaml')!r}"],
        "wrong section": ["model.train_iters: unknown key", "(did you mean train.train_iters?)",
                          "lr: unknown key: ConfigContainer has no field 'lr'", "(did you mean optimizer.lr?)"],
    }  # fmt: skip
    loaded = procs.pop("generate from the checkpoints")
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "Warning" not in loaded.stderr, loaded.stderr  # torch's deprecations inside megatron-core's loading
    for name, proc in procs.items():
        assert proc.returncode == 2, (name, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (name, proc.stderr[-3000:])
        for message in expected[name]:
            assert message in proc.stderr, (name, proc.stderr[-3000:])
    for refused_run in ("resumed", "ft"):  # refused before training: nothing saved
        assert not (tmp_path / refused_run / "checkpoints" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.slow  # several fresh processes
@pytest.mark.timeout(300)
def test_a_config_field_as_recipe_arg_a_key_without_value_a_partial_file_and_a_bad_option_name_the_fix(tmp_path):
    """Newcomer mistakes on the command line, each in a fresh process: exit status 2 with the fix."""
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "my.yaml").write_text("optimizer:\n  weight_decay: 0.05\nvalidation:\n  eval_interval: 25\n")
    argvs = {
        "config field as option": ["pretrain", "--recipe", TINY, "--recipe-arg", "model.num_layers=3", "--dry-run"],
        "option without value": ["pretrain", "--recipe", TINY, "--recipe-arg", "train_iters", "--dry-run"],
        "partial file alone": ["pretrain", "--config-file", "my.yaml", "--dry-run"],
        "generate option": ["generate", "no-model", "--prompt", "1 2", "--max-new-tokens", "0"],
    }
    expected = {
        "config field as option": "--recipe-arg model.num_layers=3: 'model' is a section of the config, not an option "
                                  f"of recipe {TINY} (give it as an override, without --recipe-arg: model.num_layers=3",
        "option without value": "train_iters: override 'train_iters' has no '=' [override 'train_iters'] (write train_iters=VALUE)",
        "partial file alone": "config file 'my.yaml' is not a complete config (it lacks train, model, dataset): to merge "
                              "it over a recipe, add --recipe NAME",
        "generate option": "1 configuration problem:\n  - --max-new-tokens: must be positive, got 0 (use 1 or more)",
    }  # fmt: skip
    with ThreadPoolExecutor(3) as pool:
        procs = dict(zip(argvs, pool.map(lambda argv: cli_process(*argv, cwd=str(tmp_path)), argvs.values())))
    for name, proc in procs.items():
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (name, proc.stderr[-3000:])
        assert expected[name] in proc.stderr, (name, proc.stderr[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_what_the_recipe_and_validation_decide_is_on_the_console(tmp_path):
    """A run prints what building the recipe and resolving the config chose for the user (a
    Hugging Face context capped, a preset's settings, a warmup scaled to a short run), from the
    command line and from `pretrain()` in a script. These lines were logged before the console
    was set up, so nobody saw them."""
    import json

    from hf_models import family_configs, save_tiny

    config = family_configs()["llama"]
    config.max_position_embeddings = 131072
    hf = save_tiny("llama", str(tmp_path / "hf"), config=config)
    data = tmp_path / "data"
    data.mkdir()
    (data / "training.jsonl").write_text("".join(json.dumps({"input": f"{i} {i}", "output": f"{i}"}) + "\n" for i in range(40)))
    out = cli_process(
        "finetune", "--recipe", "tiny_gpt_finetune_config", "--recipe-arg", f"pretrained={hf}", "--recipe-arg",
        f"dataset_root={data}", "--dir", str(tmp_path / "runs"), "train.train_iters=3", "validation.eval_iters=0",
        "checkpoint.save=null", "tokenizer.tokenizer_type=NullTokenizer", "tokenizer.vocab_size=256", timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"seq_length 4096: {hf} allows 131072 positions; give --recipe-arg seq_length=N" in out.stdout
    warmup = "scheduler.lr_warmup_iters: the recipe's warmup of 10 iterations is not shorter than the 3-iteration decay"
    assert warmup in out.stdout
    assert "mixed_precision 'fp32' set model.pipeline_dtype=float32" in out.stdout
    script = (
        "import recipes\nfrom megatron_bridge.training.gpt_step import forward_step\n"
        "from megatron_bridge.training.pretrain import pretrain\n"
        f"cfg = recipes.tiny_gpt_pretrain_config(dir={str(tmp_path / 'api')!r}, train_iters=3, eval_iters=0, save_interval=None)\n"
        "cfg.checkpoint.save = None\npretrain(cfg, forward_step)\n"
    )
    api = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=REPO, env=source_tree_env())
    assert api.returncode == 0, api.stderr[-3000:]
    assert warmup in api.stdout and "mixed_precision 'fp32' set model.pipeline_dtype=float32" in api.stdout
