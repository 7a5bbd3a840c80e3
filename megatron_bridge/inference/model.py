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
from megatron_bridge.inference.sources import ModelSource, resolve
from megatron_bridge.runtime.launcher_env import launcher_int

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
        from megatron_bridge.inference.source_tokenizer import stop_token_ids
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
    world = launcher_int("WORLD_SIZE", 1)
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
    from megatron_bridge.inference.source_tokenizer import load_tokenizer, stop_token_ids

    src = source if isinstance(source, ModelSource) else resolve(os.fspath(source), step, base)
    from megatron_bridge.inference import building  # megatron-core and the model code: once the source is checked

    tok = preloaded_tokenizer if preloaded_tokenizer is not None else load_tokenizer(src, tokenizer)
    size = tensor_parallel_size(tp)
    with building.model_parallel(tp=size, backend=backend) as device:
        module, provider = building.build(src, device, dtype)
        yield InferenceModel(module, tok, vocab_size=int(provider.vocab_size), seq_length=int(provider.seq_length),
                             stop_ids=stop_token_ids(src, tok), source=src)  # fmt: skip
