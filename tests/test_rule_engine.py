"""The rule engine: `runtime_config_update` and `validate()` take the declared rules in the order
`mbridge config rules` prints; checks cannot change the config."""

import copy
import logging
import re

import pytest
from factories import tiny_config

from megatron_bridge.cli.main import main
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.rules import Rule, run_rules
from megatron_bridge.training.config import TrainingConfig, runtime_config_update
from megatron_bridge.training.config.runtime import RULES


def printed_rules(capsys) -> list[tuple[str, str, str]]:
    """(kind, name, notes) of each numbered line `mbridge config rules` prints."""
    assert main(["config", "rules"]) == 0
    out = capsys.readouterr().out
    found = re.findall(r"^\s*\d+\. (\w+)\s+(.+?)(?:  \[(.*)\])?$", out, re.M)
    assert [n for n in re.findall(r"^\s*(\d+)\.", out, re.M)] == [str(i) for i in range(1, len(found) + 1)]
    return found


def taken(caplog) -> list[str]:
    return [r.getMessage().removeprefix("rule: ") for r in caplog.records if r.name == "megatron_bridge.config.rules"]


def test_runtime_config_update_takes_every_rule_in_the_printed_order(capsys, caplog):
    printed = printed_rules(capsys)
    assert [(kind, name) for kind, name, _ in printed] == [(r.kind, r.name) for r in RULES]
    assert len(printed) >= 25
    cfg = tiny_config(mixed_precision="bf16_mixed")
    with caplog.at_level(logging.DEBUG, logger="megatron_bridge.config.rules"):
        runtime_config_update(cfg, world_size=1, device="cpu")
    assert taken(caplog) == [name for _, name, notes in printed if "only on cuda" not in notes]
    assert cfg.model.bf16 and cfg.model.use_cpu_initialization  # the preset and the CPU rule ran

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="megatron_bridge.config.rules"):
        runtime_config_update(tiny_config(), world_size=1, device="cuda")  # a GPU run: no CPU adaptation
    assert taken(caplog) == [name for _, name, notes in printed if "only on cpu" not in notes]

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="megatron_bridge.config.rules"):
        runtime_config_update(tiny_config(), world_size=1)  # for no device (a dry run)
    assert taken(caplog) == [name for _, name, notes in printed if "only on" not in notes]


def test_validate_takes_only_the_rules_not_marked_runtime_only(capsys, caplog):
    printed = printed_rules(capsys)
    cfg = tiny_config(mixed_precision="bf16_mixed")
    with caplog.at_level(logging.DEBUG, logger="megatron_bridge.config.rules"):
        cfg.validate()
    assert taken(caplog) == [name for _, name, notes in printed if "runtime_config_update only" not in notes]
    assert "mixed precision" not in taken(caplog) and cfg.model.bf16 is False  # the preset is not applied
    assert cfg.data_parallel_size == 1 and cfg.validation.eval_global_batch_size == cfg.train.global_batch_size


def test_a_check_that_changes_the_config_fails_loudly():
    cfg = tiny_config()
    runtime_config_update(cfg, world_size=1)

    def sets_a_field(cfg, problems):
        """A check that wrongly derives a value."""
        cfg.train.train_iters = 7

    def applies_a_default(cfg, problems):
        cfg.scheduler.apply_default("lr_warmup_iters", 3)

    def derives(cfg, problems):
        cfg.validation._derive("eval_iters", 5)

    for run, where in ((sets_a_field, "TrainingConfig.train_iters"), (applies_a_default, "SchedulerConfig.lr_warmup_iters"),
                       (derives, "ValidationConfig.eval_iters")):  # fmt: skip
        with pytest.raises(RuntimeError, match=rf"{where} changed while the config is read-only \(during a check\)"):
            run_rules([Rule("wrong", "check", run)], cfg, Problems(), {})
    assert cfg.train.train_iters != 7 and cfg.validation.eval_iters != 5
    # A new config object (a check may build one to compare against) stays writable, as do copies.
    def builds_and_copies(cfg, problems):
        TrainingConfig(train_iters=3).train_iters = 4
        copy.copy(cfg.train).train_iters = 9

    run_rules([Rule("fine", "check", builds_and_copies)], cfg, Problems(), {})
    run_rules([Rule("fine", "derive", sets_a_field)], cfg, Problems(), {})  # other kinds may change fields
    assert cfg.train.train_iters == 7


def test_a_rule_of_unknown_kind_is_refused():
    with pytest.raises(ValueError, match=r"rule 'x': unknown kind 'guess' \(one of setup, adapt, preset, alias, sync, derive, finalize, check\)"):
        Rule("x", "guess", lambda cfg, problems: None)
