"""Recipes on the command line: your own (`module.path:function`, `file.py:function`), the world
size a recipe is laid out for surviving YAML, and commands that list or explain without importing
megatron-core."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import textwrap

import pytest

import recipes
from megatron_bridge.cli.main import SUBCOMMANDS
from megatron_bridge.cli.recipe_loader import library_rows

from test_cli import REPO, assert_usage_error, cli

CUSTOM = textwrap.dedent(
    '''
    from recipes._base import pretrain_config, recipe
    from megatron_bridge.models import TinyGPTModelProvider

    @recipe(world_size=2, precision_config="fp32", use_distributed_optimizer=False, comm_overlap=False,
            train_iters=20, lr_warmup_iters=2, global_batch_size=8, micro_batch_size=2, num_workers=0)
    def {name}_pretrain_config(opts):
        """A tiny GPT for two processes."""
        return pretrain_config(TinyGPTModelProvider(), opts)

    def plain_config():
        from recipes import tiny_gpt_pretrain_config
        return tiny_gpt_pretrain_config(dir={dir!r})
    '''
)


def test_fast_commands_do_not_import_megatron_core_or_torch():
    """`mbridge --help`, `mbridge recipes` and every subcommand's --help, in one fresh process."""
    code = textwrap.dedent(
        f"""
        import sys
        from megatron_bridge.cli.main import main
        for argv in [['--help'], ['recipes'], *[[c, '--help'] for c in {list(SUBCOMMANDS)!r}]]:
            try:
                main(argv)
            except SystemExit:
                pass
        heavy = sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'megatron', 'recipes', 'transformers', 'safetensors'}})
        print('HEAVY', heavy)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tiny_gpt_pretrain_config" in proc.stdout  # `mbridge recipes` listed them
    assert "HEAVY []" in proc.stdout


def test_recipe_table_read_from_source_matches_the_library():
    imported = sorted(
        (name, recipes.get_recipe(name).world_size, inspect.getdoc(recipes.get_recipe(name)).splitlines()[0])
        for name in recipes.list_recipes()
    )
    assert library_rows() == imported


def test_recipe_from_a_file(tmp_path, capsys):
    path = tmp_path / "my_recipes.py"
    path.write_text(CUSTOM.format(name="file_tiny", dir=str(tmp_path / "runs")))
    code, out, err = cli(capsys, "pretrain", "--recipe", f"{path}:file_tiny_pretrain_config", "--dry-run",
                         "--dir", str(tmp_path / "runs"))  # fmt: skip
    assert code == 0, err
    assert "# ---- dry run of file_tiny_pretrain_config at world size 2 (the recipe's world size)" in out


def test_recipe_from_a_module(tmp_path, capsys, monkeypatch):
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "recipes.py").write_text(CUSTOM.format(name="module_tiny", dir=str(tmp_path / "runs")))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = cli(capsys, "pretrain", "--recipe", "my_pkg.recipes:plain_config", "--dry-run")
    assert code == 0, err
    # a plain function: the world size its config records (from the library recipe it calls)
    assert "# ---- dry run of plain_config at world size 1 (the recipe's world size)" in out
    code, out, err = cli(capsys, "pretrain", "--recipe", "my_pkg.recipes:module_tiny_pretrain_config", "--dry-run",
                         "--dir", str(tmp_path / "runs"), "train.train_iters=10")  # fmt: skip
    assert code == 0, err
    assert "at world size 2 (the recipe's world size)" in out


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_pkg.recipes:fn", "no module 'no_such_pkg.recipes'"),
        ("recipes.tiny_gpt:missing_config", "recipes.tiny_gpt has no function 'missing_config'"),
        ("/no/such/file.py:fn", "no file '/no/such/file.py'"),
        ("recipes.tiny_gpt:", "expected MODULE:FUNCTION or FILE.py:FUNCTION"),
    ],
)
def test_bad_recipe_reference_is_a_usage_error(capsys, spec, message):
    code, _, err = cli(capsys, "pretrain", "--recipe", spec, "--dry-run")
    assert_usage_error(code, err, message)


def test_recipe_world_size_survives_yaml(tmp_path, capsys):
    from megatron_bridge.training.config import ConfigContainer

    cfg = recipes.llama3_8b_pretrain_config(dir=str(tmp_path / "runs"))
    path = tmp_path / "llama.yaml"
    path.write_text(cfg.to_yaml())
    assert ConfigContainer.from_yaml(str(path)).dist.recipe_world_size == 8
    code, out, err = cli(capsys, "pretrain", "--config-file", str(path), "--plan-only")
    assert code == 0, err
    assert "on 8 x H100" in out


def test_config_diff_hides_derived_fields_unless_asked(tmp_path, capsys):
    from megatron_bridge.training.config import runtime_config_update

    run = recipes.tiny_gpt_pretrain_config()
    run.train.train_iters = 30
    runtime_config_update(run, world_size=1)  # as saved with a run: derived values filled in
    path = tmp_path / "run.yaml"
    path.write_text(run.to_yaml())
    code, out, err = cli(capsys, "config", "diff", "tiny_gpt_pretrain_config", str(path))
    assert code == 0, err
    assert out.splitlines() == ["train.train_iters: 200 -> 30"]
    hidden = int(re.search(r"\((\d+) derived fields hidden; --derived shows them\)", err).group(1))
    code, out, err = cli(capsys, "config", "diff", "--derived", "tiny_gpt_pretrain_config", str(path))
    assert "scheduler.lr_decay_steps: null -> 240" in out and "data_parallel_size: null -> 1" in out
    assert "model.pipeline_dtype: null -> float32" in out  # set by the precision preset
    assert len(out.splitlines()) == hidden + 1


def test_finetune_dry_run_reports_every_problem_in_one_round(capsys):
    code, _, err = cli(capsys, "finetune", "--recipe", "tiny_gpt_finetune_config", "--dry-run")
    assert_usage_error(code, err, "2 configuration problems", "dataset.dataset_root: is not set",
                       "checkpoint.pretrained_checkpoint: finetune() needs pretrained weights")  # fmt: skip


def test_first_finetune_help_example_runs(tmp_path, capsys, monkeypatch):
    import shlex

    code, out, _ = cli(capsys, "finetune", "--help")
    lines = out.split("examples:\n", 1)[1].splitlines()
    first = [lines[0]]
    while first[-1].endswith("\\"):
        first.append(lines[len(first)])
    argv = shlex.split(" ".join(line.rstrip("\\") for line in first))
    assert argv[:2] == ["mbridge", "finetune"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny_gpt_pretrain" / "checkpoints").mkdir(parents=True)  # what `mbridge pretrain` writes
    code, out, err = cli(capsys, *argv[1:], "--dry-run")  # the real run is in tests/test_readme.py
    assert code == 0, err
    assert "dry run of tiny_gpt_finetune_config" in out


@pytest.mark.parametrize("size", [0, -3])
def test_recorded_world_size_must_be_positive(tmp_path, capsys, monkeypatch, size):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out, _ = cli(capsys, "config", "show", "tiny_gpt_pretrain_config")
    path = tmp_path / "run.yaml"
    path.write_text(out.replace("recipe_world_size: 1", f"recipe_world_size: {size}"))
    code, out, err = cli(capsys, "pretrain", "--config-file", str(path), "--dry-run")
    assert code == 2
    assert f"recipe_world_size: {size} is outside the allowed range [1, 2**31) (choose a value in that range)" in err
    assert f"data_parallel_size: world size {size} is not a positive number of processes" in err
