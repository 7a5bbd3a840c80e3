"""The MoE routers' auxiliary losses appear in the training log, each the mean over MoE layers
and micro batches since the last log line, without its coefficient (as megatron-core logs them)."""

from __future__ import annotations

import logging
import math

import pytest
from factories import tiny_config, tiny_llama_model

from megatron_bridge.training.config import TrainingConfig, ValidationConfig


def _logged(line: str, name: str) -> float:
    return float(line.split(f"{name} ")[1].split()[0])


@pytest.mark.timeout(300)
def test_load_balancing_and_z_losses_are_logged_per_interval(caplog):
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    model = tiny_llama_model(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    cfg = tiny_config(
        model=model,
        train=TrainingConfig(train_iters=4, global_batch_size=4, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
    )
    cfg.logger.log_interval = 2
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        pretrain(cfg, forward_step)
    lines = [r.getMessage() for r in caplog.records if "lm loss" in r.getMessage() and "iteration" in r.getMessage()]
    assert len(lines) == 2
    for line in lines:  # the second interval's values are its own, not added to the first's
        # a freshly initialized router spreads tokens about evenly: the switch loss is about 1,
        # and its logits are near 0, so the z-loss is about log(4)^2
        assert 0.95 < _logged(line, "load_balancing_loss") < 1.2, line
        assert abs(_logged(line, "z_loss") - math.log(4) ** 2) < 0.2, line
