"""Multi-token prediction (`model.mtp_num_layers`): the extra layers are built after the last
decoder layer, trained through their own loss, logged per depth, and saved with the model."""

from __future__ import annotations

import logging
import math

import pytest
from factories import tiny_config, tiny_llama_model

from megatron_bridge.training.config import CheckpointConfig, TrainingConfig, ValidationConfig


@pytest.mark.timeout(300)
def test_mtp_layers_train_log_their_loss_and_are_saved(tmp_path, caplog):
    from megatron_bridge.runtime.callbacks import Callback
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    seen = {}

    class Grads(Callback):
        def on_step_end(self, state, metrics):
            model = state.model[0].module
            seen["mtp"] = {n: p.main_grad.abs().sum().item() for n, p in model.named_parameters() if n.startswith("mtp.")}
            seen["decoder"] = sum(p.numel() for n, p in model.named_parameters() if n.startswith("decoder."))

    cfg = tiny_config(
        model=tiny_llama_model(mtp_num_layers=2),
        train=TrainingConfig(train_iters=4, global_batch_size=4, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        checkpoint=CheckpointConfig(save=str(tmp_path / "ckpt"), save_interval=4),
    )
    cfg.logger.log_interval = 2
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        state = pretrain(cfg, forward_step, callbacks=[Grads()])
    assert state.train_state.step == 4
    # two MTP depths, each a whole transformer layer of its own and the projection joining the
    # next token's embedding to the hidden state; every parameter got a gradient
    per_depth = {n.split(".")[2] for n in seen["mtp"]}
    assert per_depth == {"0", "1"}
    assert any("eh_proj" in n for n in seen["mtp"]) and all(g > 0 for g in seen["mtp"].values()), seen["mtp"]
    lines = [r.getMessage() for r in caplog.records if "iteration" in r.getMessage() and "lm loss" in r.getMessage()]
    assert len(lines) == 2
    for line in lines:
        for depth in (1, 2):
            value = float(line.split(f"mtp_{depth} loss ")[1].split()[0])
            assert abs(value - math.log(256)) < 1.5, line  # a near-uniform guess over the 256 tokens
    from megatron_bridge.runtime.checkpointing.safe_reading import read_metadata

    saved = read_metadata(str(tmp_path / "ckpt" / "iter_0000004"))
    assert any(key.startswith("mtp.layers.1.") for key in saved.state_dict_metadata), "MTP weights not saved"

    # Hugging Face's Llama has no MTP layers: the export leaves them out and says so
    from safetensors import safe_open

    from megatron_bridge.models.hf.convert import export_checkpoint

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "model.layers.1.mlp.down_proj.weight" in names and not any("mtp" in n or "layers.2" in n for n in names)
    assert "multi-token-prediction parameters (mtp.*) have no Hugging Face counterpart in llama" in caplog.text


@pytest.mark.timeout(300)
def test_a_run_logs_its_own_mtp_losses_after_another_run_in_the_process(caplog):
    # megatron-core's loss trackers live for the whole process: an earlier run (here a 3-depth
    # one, as it would leave them) must not leak into the next run's log.
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    MTPLossLoggingHelper.tracker.update(values=torch.full((3,), 1e6), reduce_group=None, avg_group=None)
    cfg = tiny_config(
        model=tiny_llama_model(mtp_num_layers=1),
        train=TrainingConfig(train_iters=2, global_batch_size=4, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
    )
    cfg.logger.log_interval = 2
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        pretrain(cfg, forward_step)
    (line,) = [r.getMessage() for r in caplog.records if "iteration" in r.getMessage() and "lm loss" in r.getMessage()]
    assert "mtp_2" not in line and abs(float(line.split("mtp_1 loss ")[1].split()[0]) - math.log(256)) < 1.5, line
