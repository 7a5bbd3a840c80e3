"""The shared recipe builder and the `@recipe` decorator.

A family file picks a model provider and its parallel defaults::

    @recipe(world_size=8, context_parallel_size=2, seq_length=8192)
    def llama3_8b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
        '''Llama 3 8B pretraining on 8 GPUs: CP2 for 8192-token sequences.'''
        return pretrain_config(Llama3ModelProvider8B(), opts)

Callers pass keyword arguments (see `PretrainOptions` / `FinetuneOptions`), which override the
recipe's defaults: `llama3_8b_pretrain_config(dir="/results", train_iters=100)`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import os
import typing
from types import MappingProxyType
from typing import Any, Callable, Optional, Union

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.models import GPTModelProvider
from megatron_bridge.peft import LoRA
from megatron_bridge.models.hf.files import has_tokenizer, hf_origin, is_hf_directory
from megatron_bridge.training.comm_overlap import CommOverlapConfig
from megatron_bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedDataParallelConfig,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    LoggerConfig,
    MockGPTDatasetConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron_bridge.training.tokenizers.config import TokenizerConfig
from recipes._options import FinetuneOptions, PretrainOptions, RecipeOptions

logger = logging.getLogger("megatron_bridge.recipes")

RECIPES: dict[str, Callable[..., ConfigContainer]] = {}
"""Every registered recipe, by function name."""

_SUFFIXES = {"_pretrain_config": PretrainOptions, "_finetune_config": FinetuneOptions}

FINETUNE_SCHEDULE: MappingProxyType = MappingProxyType(
    dict(train_iters=1000, global_batch_size=128, lr=1e-4, min_lr=0.0, lr_warmup_iters=50, eval_interval=100,
         save_interval=200)  # fmt: skip
)
"""The fine-tuning recipes' schedule on 8 GPUs: 1000 steps of 128 samples, peak LR 1e-4 after 50
warm-up steps decaying to 0, evaluation every 100 steps and a checkpoint every 200."""


# ---------------------------------------------------------------------- the decorator
def recipe(world_size: int, **defaults: Any) -> Callable[[Callable], Callable[..., ConfigContainer]]:
    """Make a recipe laid out for `world_size` GPUs (or processes), with its own option
    defaults (the library's recipes are also registered by name). The decorated function receives the merged options and returns the container;
    callers call it with keyword arguments only."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"recipe world_size must be a positive int, got {world_size!r}")

    def wrap(fn: Callable) -> Callable[..., ConfigContainer]:
        options_cls = next((cls for suffix, cls in _SUFFIXES.items() if fn.__name__.endswith(suffix)), None)
        if options_cls is None:
            raise ValueError(f"recipe {fn.__name__!r}: the name must end in {' or '.join(_SUFFIXES)}")
        merged = {"name": fn.__name__[: -len("_config")], **defaults}
        _check_names(fn.__name__, options_cls, merged)
        options_cls(**merged)  # type-check the recipe's own defaults at import time

        @functools.wraps(fn)
        def build(**kwargs: Any) -> ConfigContainer:
            _check_names(fn.__name__, options_cls, kwargs)
            if "dir" in kwargs and kwargs["dir"] is None:
                del kwargs["dir"]  # the reference system's recipes take dir=None for their default directory
            aliases = options_cls._field_aliases
            if any(aliases.get(key) in kwargs for key in kwargs):
                both = next(key for key in kwargs if aliases.get(key) in kwargs)
                raise TypeError(f"{fn.__name__}(): pass either {both!r} or {aliases[both]!r}, not both")
            kwargs = {aliases.get(key, key): value for key, value in kwargs.items()}  # they replace the recipe's defaults
            try:
                opts = options_cls(**{**merged, **kwargs})
            except TypeError as exc:
                raise TypeError(f"{fn.__name__}(): {exc}") from None
            _check_run_name(opts.name)
            cfg = fn(opts)
            if cfg.dist.recipe_world_size is None:  # survives to_yaml / --config-file
                cfg.dist.apply_default("recipe_world_size", world_size)
            return cfg

        build.world_size = world_size
        build.defaults = MappingProxyType(merged)
        build.options_class = options_cls
        build.__signature__ = _signature(options_cls, merged)
        if fn.__module__.split(".")[0] == __name__.split(".")[0]:
            # The registry (`mbridge recipes`, get_recipe) lists this library's recipes; users'
            # own are named on the command line as module:function or file.py:function.
            RECIPES[fn.__name__] = build
        return build

    return wrap


def _check_run_name(name: str) -> None:
    """The run name is one directory under `dir`: a name that is empty, '.', '..', holds a '/' or
    control characters would put the outputs somewhere else (or nowhere one can type)."""
    if name and name not in (".", "..") and "/" not in name and os.sep not in name and name.isprintable():
        return
    raise ConfigValidationError(ConfigProblem(
        "name", f"{name!r} is not a run name: the outputs go to dir/name, so it is one directory name, not empty, "
        "'.' or '..', without '/' or control characters",
        "give a plain name such as 'try1' (with --name), and the directory above it with --dir",
    ))  # fmt: skip


def _check_names(recipe_name: str, options_cls: type, kwargs: dict[str, Any]) -> None:
    known = [*options_cls.__dataclass_fields__, *options_cls._field_aliases]
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise TypeError(
                f"{recipe_name}() got an unknown option {key!r}{hint} "
                f"(options: {', '.join(sorted(known))})"
            )


def _signature(options_cls: type, defaults: dict[str, Any]) -> inspect.Signature:
    """`name=default` for every option, with the recipe's defaults (what `help()` shows)."""
    hints = typing.get_type_hints(options_cls)
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter(name, keyword, default=defaults.get(name, f.default), annotation=hints[name])
        for name, f in options_cls.__dataclass_fields__.items()
    ]
    return inspect.Signature(params, return_annotation=ConfigContainer)


# ---------------------------------------------------------------------- builders
def _scheduler(opts: RecipeOptions) -> SchedulerConfig:
    """Cosine decay after a linear warmup. The warmup is a default, not a user setting: a run
    shorter than it gets a warmup scaled to the run at validation (logged)."""
    scheduler = SchedulerConfig(lr_decay_style="cosine", lr_warmup_init=0.0)
    if opts.lr_decay_iters is not None:  # left unset otherwise: validation fills in the run's length
        scheduler.lr_decay_iters = opts.lr_decay_iters
    scheduler.apply_default("lr_warmup_iters", opts.lr_warmup_iters)
    return scheduler


def pretrain_config(model: GPTModelProvider, opts: PretrainOptions) -> ConfigContainer:
    """A pretraining container for `model`: mock data unless `opts.data_paths` is given."""
    seq = _seq_length(model, opts)
    data = dict(seq_length=seq, random_seed=opts.seed, num_workers=opts.num_workers)
    if opts.data_paths is None:
        dataset = MockGPTDatasetConfig(**data)
    else:
        dataset = GPTDatasetConfig(data_path=list(opts.data_paths), **data)
    return _container(model, dataset, opts)


def finetune_config(model: GPTModelProvider, opts: FinetuneOptions) -> ConfigContainer:
    """A fine-tuning container for `model` on the JSONL files under `opts.dataset_root`, starting
    from the weights in `opts.pretrained_checkpoint`. When that is a Hugging Face directory, its
    config.json gives the architecture (the recipe's other model settings are kept); its
    tokenizer (or that of the Hugging Face model a checkpoint was imported from) is used unless
    `opts.tokenizer` is set."""
    pretrained = _path(opts.pretrained_checkpoint)
    if is_hf_directory(pretrained):
        model = _from_hf(model, pretrained)
        if opts.seq_length is None and model.seq_length > HF_FINETUNE_SEQ_LENGTH:
            logger.info(
                "seq_length %d: %s allows %d positions; give --recipe-arg seq_length=N (or dataset.seq_length and "
                "model.seq_length) for longer samples", HF_FINETUNE_SEQ_LENGTH, pretrained, model.seq_length,
            )  # fmt: skip
            model.seq_length = HF_FINETUNE_SEQ_LENGTH
    seq = _seq_length(model, opts)
    dataset = FinetuningDatasetConfig(
        dataset_root=_path(opts.dataset_root), seq_length=seq, seed=opts.seed, num_workers=opts.num_workers
    )
    cfg = _container(model, dataset, opts)
    cfg.checkpoint.pretrained_checkpoint = pretrained
    origin = hf_origin(pretrained)  # the directory itself, or the one a checkpoint was imported from
    if opts.tokenizer is None and has_tokenizer(origin):
        cfg.tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=origin)
    return cfg


def lora_finetune_config(model: GPTModelProvider, opts: FinetuneOptions, peft: Optional[LoRA] = None) -> ConfigContainer:
    """`finetune_config` training LoRA adapters (default: rank 16, alpha 32 on the four
    projections of every layer) on the frozen pretrained weights. Adapters wrap megatron-core's
    local linear layers, so the model is built with them (not TransformerEngine's)."""
    model.transformer_impl = "local"
    cfg = finetune_config(model, opts)
    cfg.peft = peft if peft is not None else LoRA(dim=16, alpha=32)
    return cfg


def _from_hf(recipe_model: GPTModelProvider, directory: str) -> GPTModelProvider:
    """The provider of the Hugging Face model in `directory`, with the settings the recipe chose
    for its own model that are not part of the architecture (e.g. the pipeline split)."""
    model = GPTModelProvider.from_hf(directory)
    for name in sorted(recipe_model.explicit_fields() - model.explicit_fields()):
        setattr(model, name, getattr(recipe_model, name))
    return model


HF_FINETUNE_SEQ_LENGTH = 4096
"""Tokens per sample of a recipe that fine-tunes a Hugging Face model and names no length, where
the model's context is longer: packed samples and pipeline stages use the whole length, so 131,072
(Llama 3.1's context) would make every micro batch that long."""


def _seq_length(model: GPTModelProvider, opts: RecipeOptions) -> int:
    return opts.seq_length if opts.seq_length is not None else model.seq_length


def _path(value: Optional[Union[str, os.PathLike]]) -> Optional[str]:
    return None if value is None else os.fspath(value)


def _container(model: GPTModelProvider, dataset: Any, opts: RecipeOptions) -> ConfigContainer:
    """Everything but the dataset: the same for every recipe."""
    _set_layout(model, opts)
    run_dir = os.path.join(os.fspath(opts.dir), opts.name)
    checkpoints = os.path.join(run_dir, "checkpoints")
    return ConfigContainer(
        model=model,
        dataset=dataset,
        train=TrainingConfig(
            train_iters=opts.train_iters,
            global_batch_size=opts.global_batch_size,
            micro_batch_size=opts.micro_batch_size,
            exit_signal_handler=True,  # clusters preempt with SIGTERM: save, then exit
        ),
        validation=ValidationConfig(eval_interval=opts.eval_interval, eval_iters=opts.eval_iters),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=opts.lr,
            min_lr=opts.min_lr if opts.min_lr is not None else opts.lr / 10,
            weight_decay=opts.weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            clip_grad=1.0,
        ),
        scheduler=_scheduler(opts),
        ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=opts.use_distributed_optimizer,
            check_for_nan_in_grad=True,
        ),
        tokenizer=_tokenizer(model, opts),
        checkpoint=CheckpointConfig(
            save=checkpoints,
            load=checkpoints,
            save_interval=opts.save_interval if opts.save_interval is not None else opts.train_iters,
            ckpt_format="torch_dist",
        ),
        logger=LoggerConfig(log_interval=opts.log_interval, tensorboard_dir=os.path.join(run_dir, "tb_logs")),
        rng=RNGConfig(seed=opts.seed),
        mixed_precision=opts.precision_config,
        comm_overlap=CommOverlapConfig(tp_comm_overlap=opts.tp_comm_overlap) if opts.comm_overlap else None,
    )


def _set_layout(model: GPTModelProvider, opts: RecipeOptions) -> None:
    model.tensor_model_parallel_size = opts.tensor_model_parallel_size
    model.pipeline_model_parallel_size = opts.pipeline_model_parallel_size
    model.virtual_pipeline_model_parallel_size = opts.virtual_pipeline_model_parallel_size
    model.context_parallel_size = opts.context_parallel_size
    model.sequence_parallel = opts.sequence_parallel
    if model.num_moe_experts or opts.expert_model_parallel_size != 1:
        model.expert_model_parallel_size = opts.expert_model_parallel_size
    if opts.expert_tensor_parallel_size is not None:
        model.expert_tensor_parallel_size = opts.expert_tensor_parallel_size
    model.seq_length = _seq_length(model, opts)


def _tokenizer(model: GPTModelProvider, opts: RecipeOptions) -> TokenizerConfig:
    if opts.tokenizer is None:
        return TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=model.vocab_size)
    return TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=_path(opts.tokenizer))
