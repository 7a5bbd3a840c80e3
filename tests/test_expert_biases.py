"""Experts with biases (models.layers.expert_bias) in real training: megatron-core's own expert
MLP adds the probability-scaled bias in place, which autograd refuses."""

from __future__ import annotations

import math

import pytest
from factories import tiny_config, tiny_model


@pytest.mark.timeout(300)
def test_experts_with_biases_train_with_probabilities_on_the_input():
    """megatron-core's expert MLP adds the scaled bias in place (refused by autograd); the biased
    experts scale the input instead and add the bias unweighted."""
    from megatron_bridge.runtime.callbacks import Callback
    from megatron_bridge.training.config import TrainingConfig, ValidationConfig
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    seen = {"losses": []}

    class Record(Callback):
        def on_step_end(self, state, metrics):
            seen["losses"].append(float(metrics["lm loss"]))
            params = state.model[0].module.named_parameters()
            seen["bias grads"] = [p.main_grad.abs().sum().item() for n, p in params if "experts" in n and n.endswith("fc2.bias")]

    model = tiny_model(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=1, moe_router_pre_softmax=True,
                       moe_apply_probs_on_input=True, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    cfg = tiny_config(
        model=model,
        train=TrainingConfig(train_iters=2, global_batch_size=4, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
    )
    pretrain(cfg, forward_step, callbacks=[Record()])
    assert len(seen["losses"]) == 2 and all(math.isfinite(x) for x in seen["losses"])
    assert len(seen["bias grads"]) == 8 and any(g > 0 for g in seen["bias grads"]), seen["bias grads"]
