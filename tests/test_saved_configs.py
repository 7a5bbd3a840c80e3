"""Config files written by an earlier version of the package still load.

`tests/data/saved_configs/` holds the YAML of several recipes as `to_yaml` wrote it, some as the
recipe returns it and some resolved by `runtime_config_update` (what a run saves as
`run_config.yaml`). Each must load, carry every value and bookkeeping tag it was written with, and
a resolved one must resolve again to itself.
"""

import logging
import pathlib

import pytest

from megatron_bridge.config.serialization import to_dict
from megatron_bridge.config.yaml_input import load_file
from megatron_bridge.training.config import ConfigContainer, runtime_config_update

SAVED = sorted((pathlib.Path(__file__).parent / "data" / "saved_configs").glob("*.yaml"))

MOVED = {"recipe_world_size": ("dist", "recipe_world_size")}
"""Fields that moved into a section since the files were written: old key -> (section, field)."""


def _where_kept_now(written: dict) -> dict:
    """`written` with each moved field, and the `_implicit_` entry naming it, in its section."""
    written = dict(written)
    for key, (section, name) in MOVED.items():
        if key in written:
            written[section] = {**written[section], name: written.pop(key)}
            implicit = written.pop("_implicit_", [])
            if key in implicit:
                written[section]["_implicit_"] = [*written[section].get("_implicit_", ()), name]
            rest = [n for n in implicit if n != key]
            if rest:  # an empty list is not written
                written["_implicit_"] = rest
    return written


def _contained(written, now, path="") -> list[str]:
    """Where `now` (the loaded config, encoded again) lacks or changes what `written` holds."""
    if isinstance(written, dict):
        if not isinstance(now, dict):
            return [f"{path}: {now!r} is not a mapping"]
        return [d for k, v in written.items() for d in _contained(v, now.get(k, "<missing>"), f"{path}.{k}")]
    return [] if written == now else [f"{path}: written {written!r}, loaded {now!r}"]


def test_the_saved_configs_are_there():
    assert len(SAVED) >= 8
    assert {p.name.split(".")[1] for p in SAVED} == {"recipe", "resolved", "resolved_cpu"}


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.name)
def test_a_saved_config_loads_with_everything_it_holds(path):
    written = _where_kept_now(load_file(path))
    cfg = ConfigContainer.from_yaml(path)
    assert _contained(written, to_dict(cfg)) == []
    if ".resolved" in path.name:
        m = cfg.model
        world = cfg.data_parallel_size * m.tensor_model_parallel_size * m.pipeline_model_parallel_size
        world *= m.context_parallel_size
        logging.disable(logging.WARNING)
        try:
            runtime_config_update(cfg, world_size=world, device="cpu" if "cpu" in path.name else None)
        finally:
            logging.disable(logging.NOTSET)
        assert _contained(written, to_dict(cfg)) == []


def test_a_top_level_recipe_world_size_of_an_earlier_version_loads_into_dist(tmp_path):
    """The container's fields are the reference system's (plus env_vars and data_parallel_size):
    the world size a recipe records moved into `dist`. Files with the old key load it there, as
    the recipe's record (not the user's setting); hand-written ones as the user's."""
    import dataclasses

    saved = next(p for p in SAVED if p.name == "llama3_8b_pretrain.recipe.yaml")
    assert "\nrecipe_world_size: 8\n" in saved.read_text()
    cfg = ConfigContainer.from_yaml(saved)
    assert (cfg.dist.recipe_world_size, cfg.dist.is_explicit("recipe_world_size")) == (8, False)
    assert "recipe_world_size" not in {f.name for f in dataclasses.fields(ConfigContainer)}
    hand_written = tmp_path / "mine.yaml"
    hand_written.write_text(saved.read_text().replace("\nrecipe_world_size: 8\n", "\n").replace("\n_implicit_: [recipe_world_size]", "") + "recipe_world_size: 4\n")
    cfg = ConfigContainer.from_yaml(hand_written)
    assert (cfg.dist.recipe_world_size, cfg.dist.is_explicit("recipe_world_size")) == (4, True)
