"""The run config saved with a checkpoint, read through one reader (runtime.checkpointing.run_config)
by every part that looks at a checkpoint: a typed view of a real saved file, and the errors a
broken file gives."""

from __future__ import annotations

import pathlib

import pytest
from factories import tiny_config

from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.models.hf.files import run_config_value
from megatron_bridge.peft import LoRA
from megatron_bridge.peft.apply import saved_with_peft
from megatron_bridge.runtime.checkpointing import layout
from megatron_bridge.runtime.checkpointing.run_config import find_run_config, read_run_config
from megatron_bridge.training.config import ConfigContainer
from megatron_bridge.training.utils.omegaconf_utils import process_config_with_overrides


def _save(root: pathlib.Path, cfg: ConfigContainer, iteration: int = 5) -> pathlib.Path:
    """A checkpoint directory as a run leaves it, as far as its run config goes."""
    directory = pathlib.Path(layout.iteration_dir(str(root), iteration))
    directory.mkdir(parents=True)
    cfg.to_yaml(directory / layout.RUN_CONFIG_FILE)
    layout.write_tracker(str(root), iteration)
    return directory


def test_a_saved_run_config_reads_back_as_sections_values_and_the_config_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("MB_TEST_RUN_NAME", "from-env")
    cfg = process_config_with_overrides(
        tiny_config(), cli_overrides=["train.train_iters=7", "logger.wandb_exp_name=${oc.env:MB_TEST_RUN_NAME}"]
    )
    directory = _save(tmp_path / "save", cfg)
    assert "${oc.env:MB_TEST_RUN_NAME}" in (directory / layout.RUN_CONFIG_FILE).read_text()  # as the run read it

    saved = find_run_config(str(tmp_path / "save"))  # the save directory: its latest iteration
    assert saved is not None and saved.directory == str(directory)
    assert saved.value("train", "train_iters") == 7
    assert saved.section("model")["num_layers"] == cfg.model.num_layers
    assert saved.value("logger", "wandb_exp_name") == "from-env"  # the environment's value, here
    assert saved.value("train", "no_such_field") is None and saved.section("no_such_section") == {}
    assert not saved.with_peft
    rebuilt = saved.build()
    assert isinstance(rebuilt, ConfigContainer) and rebuilt.train.train_iters == 7
    assert saved.build("model").num_layers == cfg.model.num_layers

    assert saved_with_peft(str(tmp_path / "save")) is False
    assert run_config_value(str(directory), "logger", "wandb_exp_name") == "from-env"
    adapters = _save(tmp_path / "peft", tiny_config(peft=LoRA()))
    assert read_run_config(str(adapters)).with_peft and saved_with_peft(str(adapters)) is True


def test_no_checkpoint_or_no_run_config_is_none(tmp_path):
    assert find_run_config(str(tmp_path / "absent")) is None
    assert find_run_config(str(tmp_path / "save"), step=3) is None
    bare = tmp_path / "iter_0000003"
    bare.mkdir()
    assert read_run_config(str(bare)) is None and find_run_config(str(bare)) is None
    assert saved_with_peft(str(bare)) is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: {num_layers: 2\n", "invalid YAML"),
        ("- model\n- train\n", "holds a list, not the sections of a run config"),
        ("model: {}\nmodel: {}\n", "key 'model' is given twice"),  # the hardened reader refuses it
    ],
)
def test_a_broken_run_config_is_an_error_naming_the_file(tmp_path, text, message):
    directory = tmp_path / "iter_0000001"
    directory.mkdir()
    path = directory / layout.RUN_CONFIG_FILE
    path.write_text(text)
    with pytest.raises(ConfigValidationError) as err:
        read_run_config(str(directory))
    assert str(path) in str(err.value) and message in str(err.value)
    assert saved_with_peft(str(directory)) is None  # a check that only asks: no readable checkpoint
