"""Parameter-efficient fine-tuning: LoRA and DoRA adapters on megatron-core's linear layers.

`LoRA` / `DoRA` are the config sections (`ConfigContainer.peft`); importing them is cheap. The
rest loads on use: `apply` (wrapping a built model), `modules` (the adapter layer), `merge`
(folding adapters into the base weights), `export` (writing them in the `peft` library's
format), `hf_names` (megatron-core module names to Hugging Face ones).
"""

from megatron_bridge.peft.config import DoRA, LoRA

__all__ = ["DoRA", "LoRA"]
