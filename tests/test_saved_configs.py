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
    written = load_file(path)
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
