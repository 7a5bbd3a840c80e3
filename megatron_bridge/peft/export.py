"""`export_adapters`: a PEFT run's adapters in the format of the `peft` library.

Writes `adapter_config.json` and `adapter_model.safetensors` with Hugging Face module names
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, ...), which `peft`
(`PeftModel.from_pretrained`) and serving tools that load LoRA adapters read. Only the adapter
tensors are read from the checkpoint (no model is built): they are small even for large models.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from megatron_bridge.extras import require
from megatron_bridge.peft.merge import read_adapter_checkpoint
from megatron_bridge.runtime.checkpointing import layout
from megatron_bridge.runtime.checkpointing.safe_reading import load_common, read_metadata
from megatron_bridge.models.hf.files import hf_origin, is_hf_directory, run_config_value
from megatron_bridge.peft.hf_names import UnmappedModuleError, hf_modules, hf_row_order, split_rows
from megatron_bridge.runtime.checkpointing.weights import is_adapter_key

PEFT_PREFIX = "base_model.model."
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_PARAM = {"lora_A": "lora_A.weight", "lora_B": "lora_B.weight", "lora_magnitude": "lora_magnitude_vector"}
"""Our adapter parameter -> its name under a module in the peft format."""


def read_adapter_tensors(iteration_dir: str) -> dict[str, Any]:
    """The adapter tensors of a PEFT checkpoint, whole (not split over ranks), by module name and
    parameter: {'decoder.layers.0.self_attention.linear_qkv.lora_A': tensor, ...}."""
    import torch
    import torch.distributed.checkpoint as dcp

    metadata = read_metadata(iteration_dir).state_dict_metadata
    reader = dcp.FileSystemReader(iteration_dir)
    keys = [k for k in metadata if not k.startswith("optimizer.") and is_adapter_key(k)]
    tensors = {k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype) for k in keys}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def to_peft_state(tensors: dict[str, Any], model_cfg: Any, hf_config: Optional[dict] = None) -> dict[str, Any]:
    """Our adapter tensors under peft-format Hugging Face names (fused projections split; rows in
    the order of the Hugging Face weights of `hf_config`, the config.json the base came from)."""
    out = {}
    for key, tensor in sorted(tensors.items()):
        module, param = key.rsplit(".", 1)
        if ".experts." in module:
            raise UnmappedModuleError(
                f"{module}: adapters on MoE experts have no peft-format counterpart here (Hugging Face MoE models "
                "keep their experts in fused tensors); train without expert targets to export"
            )
        names = hf_modules(module, model_cfg)
        if param != "lora_A":
            tensor = hf_row_order(module, tensor, hf_config)
        parts = (tensor,) * len(names) if param == "lora_A" else split_rows(module, tensor, model_cfg)
        for name, part in zip(names, parts):
            out[f"{PEFT_PREFIX}{name}.{PEFT_PARAM[param]}"] = part.clone()  # one copy per HF module
    return out


def peft_config(peft: Any, modules: list[str], num_layers: int, base_model: Optional[str]) -> dict[str, Any]:
    """`adapter_config.json` for adapters on the HF `modules` (full names)."""
    leaves = sorted({m.rsplit(".", 1)[-1] for m in modules})
    kinds = {m.split(".", 3)[3] for m in modules}  # model.layers.N.<kind>
    complete = set(modules) == {f"model.layers.{i}.{kind}" for i in range(num_layers) for kind in kinds}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": peft.dim,
        "lora_alpha": peft.alpha,
        "lora_dropout": peft.dropout,
        # Short names when every layer has the same adapters (what serving tools expect); else exact names.
        "target_modules": leaves if complete else sorted(modules),
        "use_dora": peft.method_name == "DoRA",
        "use_rslora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def hf_base_model(path: Optional[str], depth: int = 4) -> Optional[str]:
    """The Hugging Face directory holding exactly the weights at `path`, as an absolute path: `path`
    itself when it is one; for a checkpoint of ours, the directory it was imported from (`mbridge hf
    import`, weights only), or for a PEFT checkpoint, that of its frozen base. None when there is
    none (a model trained or merged here has no Hugging Face counterpart)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    if not path or depth <= 0:
        return None
    if is_hf_directory(path):
        return os.path.abspath(path)
    try:
        directory, _ = layout.resolve(path)
        common = load_common(directory)
    except (OSError, ValueError, CheckpointingException):
        return None
    record = common.get("peft")
    if record:  # the adapters' base is recorded with an absolute path
        base = record.get("pretrained_iteration_dir") or record.get("pretrained_checkpoint")
    elif common.get("weights_only"):
        base = run_config_value(directory, "checkpoint", "pretrained_checkpoint")
    else:
        return None
    return hf_base_model(base, depth - 1)


def export_adapters(checkpoint: str, out_dir: str, base_model: Optional[str] = None) -> list[str]:
    """Write the adapters of the PEFT checkpoint `checkpoint` to `out_dir` in the peft format;
    returns the files written. `base_model` goes into the config as `base_model_name_or_path`
    (default: the Hugging Face directory of the base weights the adapters were trained on, so
    `AutoPeftModelForCausalLM.from_pretrained(out_dir)` loads both; without one, the base
    checkpoint of ours)."""
    safetensors_torch = require("safetensors.torch", "writing adapters in the peft format")
    from megatron_bridge.models.hf.convert import origin_config

    directory, _, cfg, common = read_adapter_checkpoint(checkpoint)
    hf_config = origin_config(cfg.model, hf_origin(directory))
    state = to_peft_state(read_adapter_tensors(directory), cfg.model, hf_config)
    modules = sorted({k[len(PEFT_PREFIX) :].rsplit(".lora_", 1)[0] for k in state})
    if base_model is None:
        base_model = hf_base_model(directory) or common["peft"].get("pretrained_checkpoint")
    config = peft_config(cfg.peft, modules, cfg.model.num_layers, base_model)
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, WEIGHTS_FILE)
    safetensors_torch.save_file(state, weights, metadata={"format": "pt"})
    config_path = os.path.join(out_dir, CONFIG_FILE)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return [config_path, weights]
