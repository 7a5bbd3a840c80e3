"""A model ready for inference: the megatron-core module, its tokenizer, and what bounds it.

`load_model(source)` builds the model of a Hugging Face directory or of one of our checkpoints
(a LoRA/DoRA checkpoint: its base, then its adapters on top) split over the processes of the
launch as tensor parallelism, on the GPU when there is one, else on the CPU. A run's own model
(inside a training callback) is used through `InferenceModel.from_module`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

from megatron_bridge.inference.errors import SourceError
from megatron_bridge.inference.sources import ADAPTERS, HF, ModelSource, read_run_config, resolve
from megatron_bridge.config.errors import Problems
from megatron_bridge.inference.source_tokenizer import load_tokenizer, stop_token_ids

BACKENDS = ("auto", "nccl", "gloo")
"""Process-group backends a model loads with: auto is nccl where GPUs are visible, else gloo."""


@dataclass
class InferenceModel:
    """A megatron-core GPT model (one pipeline stage holding every layer) and its tokenizer."""

    module: Any
    """The GPTModel; called with (tokens, position_ids, attention_mask, ...) like in training."""

    tokenizer: Any = None
    """The tokenizer (None when the source has none: token-id data can still be scored)."""

    vocab_size: int = 0
    """The model's real vocabulary: logit rows beyond it are padding and never count."""

    seq_length: int = 0
    """The longest sequence the model takes (prompt plus generated tokens)."""

    stop_ids: frozenset = field(default_factory=frozenset)
    """Token ids that end a generation (end of sequence, end of turn)."""

    source: Optional[ModelSource] = None
    """Where the weights came from (None for a run's own model)."""

    @classmethod
    def from_module(cls, module: Any, tokenizer: Any = None) -> "InferenceModel":
        """A model of a running job (one of `state.model`, wrappers included) with its tokenizer.
        It must hold the whole model (pipeline-parallel size 1)."""
        from megatron_bridge.runtime.checkpointing.weights import unwrap

        bare = unwrap(module)
        config = bare.config
        if not (bare.pre_process and bare.post_process):
            raise ValueError("inference needs the whole model in one process (pipeline_model_parallel_size=1)")
        return cls(bare, tokenizer, vocab_size=int(config.vocab_size), seq_length=int(bare.max_sequence_length),
                   stop_ids=stop_token_ids(None, tokenizer))  # fmt: skip

    @property
    def device(self) -> Any:
        return next(self.module.parameters()).device

    @property
    def sliding_window(self) -> bool:
        """Attention limited to a window: megatron-core then builds its own mask and ignores the
        padding mask, so a batch must hold prompts of one length."""
        return getattr(self.module.config, "window_size", None) is not None

    def logits(self, tokens: Any, position_ids: Any, attention_mask: Any, inference_context: Any = None) -> Any:
        """Float32 logits [batch, positions, vocab_size] (the last position only with a cache)."""
        out = self.module(tokens, position_ids, attention_mask, inference_context=inference_context,
                          runtime_gather_output=True)  # fmt: skip
        return out[..., : self.vocab_size].float()

    @contextlib.contextmanager
    def evaluating(self) -> Iterator["InferenceModel"]:
        """Eval mode and no gradients inside; the module's mode is restored after."""
        import torch

        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                yield self
        finally:
            self.module.train(was_training)


ModelLike = Union[str, os.PathLike, ModelSource, InferenceModel]


@contextlib.contextmanager
def open_model(model: ModelLike, **load_options: Any) -> Iterator[InferenceModel]:
    """`model` itself if it is loaded, else `load_model(model, **load_options)` for the block."""
    if isinstance(model, InferenceModel):
        yield model
        return
    with load_model(model, **load_options) as loaded:
        yield loaded


def tensor_parallel_size(tp: Optional[int]) -> int:
    """The tensor-parallel size: `tp`, else every process of the launch (there is no data
    parallelism in inference)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = world if tp is None else tp
    if tp < 1 or tp != world:
        raise SourceError(f"--tp {tp} must equal the number of processes ({world}): inference splits the model over all of them")
    return tp


@contextlib.contextmanager
def load_model(source: Union[str, os.PathLike, ModelSource], *, step: Optional[int] = None, base: Optional[str] = None,
               tokenizer: Optional[str] = None, tp: Optional[int] = None, dtype: Optional[str] = None,
               backend: str = "auto", preloaded_tokenizer: Any = None) -> Iterator[InferenceModel]:  # fmt: skip
    """Build and load the model of `source` (a path, or a resolved `ModelSource`) for the block:
    process groups and the CPU backend live as long as it. `tokenizer` replaces the source's
    tokenizer; `dtype` (bf16, fp16, fp32) the weights' dtype (default: the dtype they are stored
    in); `tp` the tensor-parallel size (default: the number of processes); `backend` the
    process-group backend (auto: nccl on the GPUs where they are visible, else gloo on the CPU).
    More processes on a machine than visible GPUs with nccl is a `ConfigValidationError` before
    anything is built."""
    from megatron_bridge.models.hf.runtime import model_parallel

    src = source if isinstance(source, ModelSource) else resolve(os.fspath(source), step, base)
    tok = preloaded_tokenizer if preloaded_tokenizer is not None else load_tokenizer(src, tokenizer)
    size = tensor_parallel_size(tp)
    with model_parallel(tp=size, backend=backend) as device:
        module, provider = _build(src, device, dtype)
        yield InferenceModel(module, tok, vocab_size=int(provider.vocab_size), seq_length=int(provider.seq_length),
                             stop_ids=stop_token_ids(src, tok), source=src)  # fmt: skip


def _provider(src: ModelSource) -> Any:
    if src.kind == HF:
        from megatron_bridge.models.hf.load import check_hf_directory

        problems = Problems()
        provider = check_hf_directory(src.directory, problems)
        if provider is None:
            lines = [f"  - {p.message}" + (f" ({p.fix})" if p.fix else "") for p in problems.items]
            raise SourceError("\n".join([f"the Hugging Face model {src.directory!r} cannot be loaded:", *lines]))
        return provider
    from megatron_bridge.models.hf.convert import checkpoint_provider

    try:
        return checkpoint_provider(src.directory)
    except (ValueError, TypeError) as exc:
        raise SourceError(f"the model of {src.describe()} cannot be read: {exc}") from None


def _weights_dtype(src: ModelSource, provider: Any, dtype: Optional[str]) -> Any:
    from megatron_bridge.models.hf.writer import torch_dtype

    if dtype is not None:
        return torch_dtype(dtype)
    if src.kind == HF:
        from megatron_bridge.models.hf.config import read_hf_config
        from megatron_bridge.models.hf.convert import default_dtype

        return torch_dtype(default_dtype(provider, read_hf_config(src.directory)))
    from megatron_bridge.models.hf.runtime import stored_dtype

    return stored_dtype(provider)


def _build(src: ModelSource, device: str, dtype: Optional[str]) -> tuple[Any, Any]:
    """(the loaded GPTModel, its provider) of `src` in the current parallel state."""
    from megatron_bridge.models.hf.runtime import build_chunks, prepare

    weights = src.base if src.kind == ADAPTERS else src
    provider = _provider(src)  # adapters: the architecture their run trained (the base's)
    layout: dict[str, Any] = {"bf16": False, "fp16": False, "parallel_output": False,
                              "moe_token_dispatcher_type": "allgather"}  # fmt: skip
    if src.kind == ADAPTERS:
        layout["transformer_impl"] = "local"  # adapters wrap megatron-core's local linear layers
    provider = prepare(provider, device, params_dtype=_weights_dtype(weights, provider, dtype), **layout)
    (module,) = build_chunks(provider, device)
    _load_complete_weights(module, weights)
    if src.kind == ADAPTERS:
        _add_adapters(module, src)
    module.eval()
    return module, provider


def _load_complete_weights(module: Any, src: ModelSource) -> None:
    if src.kind == HF:
        from megatron_bridge.models.hf.load import load_hf_weights

        load_hf_weights([module], src.directory)
        return
    from megatron_bridge.models.hf.runtime import load_checkpoint_weights

    try:
        load_checkpoint_weights([module], src.directory)
    except Exception as exc:  # dist_checkpointing names mismatched tensors in many exception types
        raise SourceError(f"the weights of {src.describe()} do not fit its model: {exc}") from None


def _add_adapters(module: Any, src: ModelSource) -> None:
    from megatron_bridge.peft.apply import apply_peft, base_weights_loaded
    from megatron_bridge.peft.offline import load_weights

    saved = read_run_config(src.directory)
    peft = saved.build("peft")
    seed = saved.value("rng", "seed")
    seed = 1234 if seed is None else int(seed)  # RNGConfig's default
    apply_peft(module, peft, seed=seed)
    base_weights_loaded(module)
    load_weights(module, src.directory, "adapters")
