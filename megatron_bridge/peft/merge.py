"""`merge_checkpoint`: a full checkpoint with a PEFT run's adapters folded into its base weights.

The adapters' checkpoint records the base it was trained on; both are loaded into the unsplit
model in one process (megatron-core reshards whatever layout they were saved in), every adapter
is folded in (W + scale * B @ A; DoRA also rescales each row to its magnitude), and the plain
model is saved as an ordinary checkpoint: `pretrained_checkpoint` of a later run, or resumable
(without optimizer state) at the adapters' iteration.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Optional
from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.config.serialization import to_dict
from megatron_bridge.models.hf.files import check_replaceable, copy_hf_assets, hf_origin
from megatron_bridge.models.saved_architecture import base_mismatch
from megatron_bridge.runtime.checkpointing import layout, weights
from megatron_bridge.runtime.checkpointing.results_queue import use_results_queue
from megatron_bridge.runtime.checkpointing.run_config import read_run_config
from megatron_bridge.runtime.checkpointing.safe_reading import load_common
from megatron_bridge.peft.apply import merge_and_unwrap
from megatron_bridge.peft.offline import load_weights, single_process_model

logger = logging.getLogger("megatron_bridge")


def read_adapter_checkpoint(path: str) -> tuple[str, int, Any, dict]:
    """(iteration dir, iteration, run config, common state) of the PEFT checkpoint at `path`;
    ValueError if it holds no adapters."""
    directory, iteration = layout.resolve(path)
    saved = read_run_config(directory)
    if saved is None:
        raise ValueError(
            f"{directory!r} has no {layout.RUN_CONFIG_FILE}: cannot tell which model its adapters belong to"
        )
    common = load_common(directory)
    cfg = saved.build()  # the run's ConfigContainer, by the file's _target_
    if not common.get("peft") or cfg.peft is None:
        raise ValueError(f"{directory!r} is not a PEFT checkpoint (it holds no adapters)")
    return directory, iteration, cfg, common


def base_of(cfg: Any, common: dict, base: Optional[str] = None) -> str:
    """The base weights the adapters were trained on (or `base` when given)."""
    if base is not None:
        mismatch = base_mismatch(to_dict(cfg.model), base)
        if mismatch:
            raise ValueError(f"--base {mismatch}")
        return base
    record = common["peft"]
    recorded = record.get("pretrained_iteration_dir") or record.get("pretrained_checkpoint")
    if recorded and os.path.isdir(recorded):
        return recorded
    if cfg.checkpoint.pretrained_checkpoint and os.path.isdir(cfg.checkpoint.pretrained_checkpoint):
        return cfg.checkpoint.pretrained_checkpoint
    raise FileNotFoundError(
        f"the base weights of these adapters ({recorded!r}) are not there; give their directory with --base DIR"
    )


def merge_checkpoint(adapters: str, out: str, base: Optional[str] = None) -> str:
    """Fold the adapters of the PEFT checkpoint `adapters` into their base and save the result
    under `out` (as `out/iter_N`, N the adapters' iteration); returns that directory."""
    directory, iteration, cfg, common = read_adapter_checkpoint(adapters)
    fix = f"give a new or empty directory: a merge there would make its iteration {iteration} the latest"
    if os.path.realpath(layout.iteration_dir(out, iteration)) == os.path.realpath(directory):
        raise ConfigValidationError(ConfigProblem(out, "holds the adapters being merged, which the merge would replace", fix))
    ours = (os.path.basename(layout.iteration_dir(out, iteration)), layout.TRACKER_FILE)
    check_replaceable(out, ours.__contains__, "a merge", fix)
    base_dir = base_of(cfg, common, base)
    with single_process_model(cfg) as model:
        load_weights(model, base_dir, "base")
        load_weights(model, directory, "adapters")
        count = merge_and_unwrap(model)
        final = save_model(
            model,
            out,
            iteration,
            plain_config(cfg),
            common,
            merged_from={"adapters": os.path.abspath(directory), "base": os.path.abspath(base_dir)},
            hf_assets=hf_origin(base_dir),  # what `mbridge hf export` of the merged model describes it with
        )
    logger.info("folded %d adapters of %s into %s: %s", count, directory, base_dir, final)
    return final


def plain_config(cfg: Any) -> Any:
    """The run config of the merged model: no PEFT method, no base to load."""
    import copy

    cfg = copy.deepcopy(cfg)
    cfg.peft = None
    cfg.checkpoint.pretrained_checkpoint = None
    cfg.checkpoint.load = cfg.checkpoint.save = None  # the adapters' directories, not this model's
    return cfg


def save_model(
    model: Any, out: str, iteration: int, cfg: Any, common: dict, hf_assets: Optional[str] = None, **extra: Any
) -> str:
    """Save a bare model (one process) as a complete checkpoint in `out`: written under a
    temporary name, then committed with the tracker file like the trainer's checkpoints. The
    config and tokenizer of Hugging Face directory `hf_assets` are kept with it."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    final = layout.iteration_dir(out, iteration)
    staging = final + layout.INCOMPLETE_SUFFIX
    os.makedirs(out, exist_ok=True)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    sd: dict[str, Any] = {"model": model.sharded_state_dict()}
    sd.update(
        checkpoint_version=weights.CHECKPOINT_VERSION,
        iteration=iteration,
        train_state=common.get("train_state"),
        opt_param_scheduler=common.get("opt_param_scheduler"),
        layout=weights.layout(),
        saved_rng=False,
        saved_optimizer=False,
        saved_rerun=False,
        ft_state=None,
        **extra,
    )
    use_results_queue(persistent_worker=False)  # no helper process for the writer's results
    dist_checkpointing.save(sd, staging, TorchDistSaveShardedStrategy("torch_dist", 1))
    cfg.to_yaml(os.path.join(staging, layout.RUN_CONFIG_FILE))
    copy_hf_assets(hf_assets, staging)
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.rename(staging, final)
    layout.write_tracker(out, iteration)
    torch.distributed.barrier()
    return final
