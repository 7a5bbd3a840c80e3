"""What users change most when calling a recipe: its keyword arguments, typed and documented.

A recipe declares its own defaults for these (`@recipe(world_size=..., lr=...)`); the caller's
keyword arguments override them. Values are type-checked when the options are built.
"""

from __future__ import annotations

from typing import Optional, Union

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.training.mixed_precision import MixedPrecisionConfig


@config_dataclass(kw_only=True)
class RecipeOptions(ConfigBase):
    """Options shared by pretraining and fine-tuning recipes."""

    _field_aliases = {  # NVIDIA Megatron Bridge's recipe argument names
        "tensor_parallelism": "tensor_model_parallel_size",
        "pipeline_parallelism": "pipeline_model_parallel_size",
        "virtual_pipeline_parallelism": "virtual_pipeline_model_parallel_size",
        "context_parallelism": "context_parallel_size",
        "expert_parallelism": "expert_model_parallel_size",
        "expert_tensor_parallelism": "expert_tensor_parallel_size",
        "sequence_parallelism": "sequence_parallel",
    }

    dir: str = "runs"
    """Base output directory (relative to the current directory unless absolute)."""

    name: str = "run"
    """Run name: checkpoints go to dir/name/checkpoints, TensorBoard logs to dir/name/tb_logs.
    One directory name (no '/', not '.' or '..'). Defaults to the recipe name without '_config'."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (TP)."""

    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (PP)."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule); None: not interleaved."""

    context_parallel_size: int = 1
    """Context-parallel size (CP): each sequence is split over this many ranks."""

    expert_model_parallel_size: int = 1
    """Expert-parallel size (EP), for mixture-of-experts models."""

    expert_tensor_parallel_size: Optional[int] = None
    """Tensor-parallel size inside experts (None: the same as TP)."""

    sequence_parallel: bool = False
    """Split norms and dropout over the sequence dimension across TP ranks (needs TP > 1)."""

    seq_length: Optional[int] = None
    """Tokens per sample (None: the model's context length; at most 4096 when fine-tuning a
    Hugging Face model)."""

    train_iters: int = 500_000
    """Optimizer steps to train for."""

    global_batch_size: int = 512
    """Samples per optimizer step, over all data-parallel ranks."""

    micro_batch_size: int = 1
    """Samples per forward/backward pass on one model replica."""

    lr: float = 3e-4
    """Peak learning rate."""

    min_lr: Optional[float] = None
    """Final learning rate of the cosine decay (None: lr / 10)."""

    lr_warmup_iters: int = 2000
    """Iterations of linear warmup."""

    lr_decay_iters: Optional[int] = None
    """Iterations of the cosine decay (None: train_iters)."""

    weight_decay: float = 0.1
    """AdamW weight decay."""

    precision_config: Optional[Union[MixedPrecisionConfig, str]] = "bf16_mixed"
    """Mixed-precision preset name (e.g. 'bf16_mixed', 'fp32') or config; None: leave the
    precision fields at their defaults (fp32)."""

    tokenizer: Optional[str] = None
    """Local Hugging Face tokenizer (directory or tokenizer.json); None: NullTokenizer with the
    model's vocabulary size (the data are token ids)."""

    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks."""

    comm_overlap: bool = True
    """Overlap data-parallel and pipeline communication with compute, as derived from the layout."""

    tp_comm_overlap: bool = False
    """Also overlap tensor-parallel communication with GEMMs (needs TransformerEngine, TP > 1 and
    sequence parallelism; turned off with a warning otherwise)."""

    log_interval: int = 10
    """Log every N iterations."""

    eval_interval: int = 2000
    """Evaluate every N iterations."""

    eval_iters: int = 32
    """Batches per evaluation."""

    save_interval: Optional[int] = 2000
    """Save a checkpoint every N iterations (None: only at the end, i.e. every train_iters)."""

    num_workers: int = 2
    """Dataloader worker processes."""

    seed: int = 1234
    """Random seed."""


@config_dataclass(kw_only=True)
class PretrainOptions(RecipeOptions):
    """Options of pretraining recipes."""

    data_paths: Optional[list[str]] = None
    """Megatron indexed-dataset path prefixes (optionally weights before each); None: mock data
    (random tokens)."""


@config_dataclass(kw_only=True)
class FinetuneOptions(RecipeOptions):
    """Options of fine-tuning recipes."""

    _field_aliases = {**RecipeOptions._field_aliases, "pretrained": "pretrained_checkpoint"}

    dataset_root: Optional[str] = None
    """Fine-tuning data: a directory with training.jsonl / validation.jsonl / test.jsonl, data files,
    or a datasets directory; rows of "input"/"output" or chat "messages"."""

    pretrained_checkpoint: Optional[str] = None
    """Weights to start from (weights only: no optimizer state, iterations start at 0): a
    checkpoint directory of ours, or a Hugging Face model directory, whose config.json then gives
    the model architecture and whose tokenizer is used unless `tokenizer` is set. Alias:
    `pretrained`."""
