"""Which core attention a GPT model's layers run, and why.

The core attention is the part of a self-attention layer between the projections: scores, mask,
softmax, dropout, and the weighted sum of the values. Three implementations are built:

* **te**: TransformerEngine's `DotProductAttention` (flash, fused or unfused kernels, picked by
  `model.attention_backend`), in TransformerEngine layers.
* **sdpa**: `SDPAttention`, which calls `torch.nn.functional.scaled_dot_product_attention`
  (flash or memory-efficient kernels on GPUs, a fused kernel or the math path on CPUs), in
  megatron-core's local layers. It keeps no score matrix.
* **unfused**: megatron-core's local `DotProductAttention`, which materializes the scores
  (b x heads x s x s) and runs softmax over them.

`model.attention_backend` chooses among them with megatron-core's names: `auto` (the default)
takes SDPA for local layers wherever it serves the config and the unfused path otherwise;
`unfused` and `local` keep the unfused path; `flash` and `fused` name TransformerEngine
kernels, so on local layers they mean the fused kernels local layers have, SDPA's.

`core_attention_choice` is a pure function of the model config and of what is installed: no
process group, no model. The layer spec (`GPTModelProvider.layer_spec`) and the data pipeline
(packed sequences as boundaries or as a mask) read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from megatron_bridge.config.errors import ConfigProblem, Problems
from megatron_bridge import extras

CoreAttentionKind = Literal["te", "sdpa", "unfused"]


@dataclasses.dataclass(frozen=True)
class CoreAttentionChoice:
    """The core attention `provide()` builds for every self-attention layer, and why."""

    kind: CoreAttentionKind
    """te: TransformerEngine's; sdpa: PyTorch scaled_dot_product_attention; unfused:
    megatron-core's local DotProductAttention (full score matrices)."""

    reason: str
    """One line for the log: why this kind."""

    def __str__(self) -> str:
        return f"core attention: {self.kind} ({self.reason})"


def backend_name(config: Any) -> str:
    """`model.attention_backend` as its megatron-core name (flash, fused, unfused, local, auto)."""
    value = config.attention_backend
    return str(getattr(value, "name", value))


def te_layers(config: Any) -> bool:
    """True if the model is built from TransformerEngine layers: asked for by `transformer_impl`
    and installed (a default ask falls back to local layers where TE is missing)."""
    if config.transformer_impl != "transformer_engine":
        return False
    return extras.is_installed("transformer_engine")


def sdpa_unsupported(config: Any) -> Optional[str]:
    """What in `config` the SDPA core attention cannot serve (a short phrase), or None."""
    import torch

    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        return f"torch {torch.__version__} has no scaled_dot_product_attention"
    if config.context_parallel_size > 1:
        return f"context parallelism (context_parallel_size={config.context_parallel_size})"
    if config.multi_latent_attention:
        return "multi-latent attention (multi_latent_attention=True)"
    if getattr(config, "experimental_attention_variant", None) is not None:
        return f"experimental_attention_variant={config.experimental_attention_variant!r}"
    if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
        return "qk_clip / log_max_attention_logit (they read the largest attention logit)"
    if getattr(config, "attention_logit_softcap", None) is not None:
        return "attention_logit_softcap (a cap on the scores before the softmax)"
    return None


def core_attention_choice(config: Any) -> CoreAttentionChoice:
    """The core attention `config.provide()` builds, with the reason; see the module docstring."""
    backend = backend_name(config)
    if config.transformer_layer_spec is not None:
        kind: CoreAttentionKind = "te" if te_layers(config) else "unfused"
        return CoreAttentionChoice(
            kind, "model.transformer_layer_spec builds the layers as given, with its own core attention"
        )
    if config.transformer_impl == "transformer_engine":
        if te_layers(config):
            return CoreAttentionChoice("te", f"TransformerEngine layers, attention_backend={backend}")
        if _explicit(config, "transformer_impl"):
            return CoreAttentionChoice(
                "te", "model.transformer_impl='transformer_engine' is set, but TransformerEngine is not installed here"
            )
        layers = "TransformerEngine not installed, so local layers"
    else:
        layers = f"local layers (transformer_impl={config.transformer_impl!r})"
    if backend in ("unfused", "local"):
        return CoreAttentionChoice("unfused", f"{layers}; model.attention_backend={backend} keeps megatron-core's DotProductAttention")
    why_not = sdpa_unsupported(config)
    if why_not is None:
        return CoreAttentionChoice("sdpa", f"{layers}; PyTorch SDPA serves this config (attention_backend={backend})")
    return CoreAttentionChoice("unfused", f"{layers}; SDPA cannot serve {why_not}, so megatron-core's DotProductAttention")


def check_attention(config: Any, problems: Problems) -> None:
    """Attention settings no core attention serves as asked: a window reaching after the query
    in a causal model, a window pattern of the wrong length, and `flash`/`fused` on layers that
    are local by the config (transformer_impl='local') where SDPA cannot serve the config."""
    window = config.window_size
    if window is not None:
        problems.check(
            len(window) == 2 and int(window[1]) == 0,
            "window_size",
            f"{tuple(window)!r}: a GPT layer is causal, so a window cannot reach after the query "
            "(megatron-core's local attention would show the next tokens, TransformerEngine would ignore it)",
            f"use ({window[0]}, 0)" if len(window) == 2 else "use (left, 0)",
        )
    freq = config.window_attn_skip_freq
    if isinstance(freq, list) and config.num_layers is not None:
        problems.check(
            len(freq) == config.num_layers,
            "window_attn_skip_freq",
            f"lists {len(freq)} layers, the model has num_layers={config.num_layers}",
            "give one 0/1 per layer (1: the layer has the window), or an int N (every Nth layer without it)",
        )
    backend = backend_name(config)
    if backend not in ("flash", "fused") or config.transformer_impl == "transformer_engine":
        return
    if config.transformer_layer_spec is not None:
        return
    why_not = sdpa_unsupported(config)
    problems.check(
        why_not is None,
        "attention_backend",
        f"{backend!r} asks for a fused attention kernel; local layers have SDPA's, which cannot serve {why_not}",
        "set model.attention_backend='unfused' (or 'auto'), or use TransformerEngine layers",
    )


def window_layers(config: Any) -> list[bool]:
    """Per layer (from the first), whether it has `config.window_size` (by
    `window_attn_skip_freq`, as megatron-core's attention decides it)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    return [
        is_layer_window_attention(config.window_size, config.window_attn_skip_freq, number)
        for number in range(1, config.num_layers + 1)
    ]


def _explicit(config: Any, name: str) -> bool:
    is_explicit = getattr(config, "is_explicit", None)
    return bool(is_explicit and is_explicit(name))


def core_attention_module(config: Any, choice: CoreAttentionChoice) -> Optional[type]:
    """The class that replaces megatron-core's local `DotProductAttention` in the layer spec for
    `choice`, or None to keep it: `SDPAttention` for sdpa; for unfused layers with soft-capped
    scores, `SoftcapDotProductAttention`; for unfused layers with a sliding window, the variant
    that composes the window with the mask it is given (packed samples)."""
    if choice.kind == "sdpa":
        from megatron_bridge.models.sdpa_attention import SDPAttention

        return SDPAttention
    if choice.kind == "unfused" and getattr(config, "attention_logit_softcap", None) is not None:
        from megatron_bridge.models.layers.softcap import SoftcapDotProductAttention

        return SoftcapDotProductAttention
    if choice.kind == "unfused" and config.window_size is not None:
        from megatron_bridge.models.attention_masks import WindowedDotProductAttention

        return WindowedDotProductAttention
    return None


def replace_core_attention(spec: Any, module: type) -> Any:
    """A copy of `spec` (a block spec, a layer spec or a list of them) in which every
    megatron-core `DotProductAttention` is `module`; parts shared between layers stay shared."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    memo: dict[int, Any] = {}

    def swap(obj: Any) -> Any:
        if obj is DotProductAttention:
            return module
        if isinstance(obj, type) or obj is None or isinstance(obj, (str, int, float, bool)):
            return obj
        key = id(obj)
        if key in memo:
            return memo[key]
        if isinstance(obj, (list, tuple)):
            new = type(obj)(swap(x) for x in obj)
            new = obj if all(a is b for a, b in zip(new, obj)) else new
        elif dataclasses.is_dataclass(obj):
            changes = {}
            for f in dataclasses.fields(obj):
                if not f.init or f.name in ("params", "metainfo"):
                    continue
                value = getattr(obj, f.name)
                swapped = swap(value)
                if swapped is not value:
                    changes[f.name] = swapped
            new = dataclasses.replace(obj, **changes) if changes else obj
        else:
            new = obj
        memo[key] = new
        return new

    return swap(spec)


def core_attention_recompute(config: Any) -> tuple[dict[str, Any], Optional[str]]:
    """Selective recompute of `core_attn` exists to drop the score matrices of the unfused path;
    SDPA keeps none, so recomputing it only repeats the attention. Returns the fields to derive
    (turning it off where the user did not ask for it) and a line for the log, or ({}, None)."""
    if config.recompute_granularity != "selective" or core_attention_choice(config).kind != "sdpa":
        return {}, None
    modules = list(config.recompute_modules) if config.recompute_modules is not None else ["core_attn"]
    if "core_attn" not in modules:
        return {}, None
    if _explicit(config, "recompute_modules"):
        return {}, None  # the user listed core_attn: theirs to keep
    rest = [m for m in modules if m != "core_attn"]
    if rest:
        return {"recompute_modules": rest}, (
            f"model.recompute_modules={rest}: core_attn left out, SDPA keeps no score matrix to drop"
        )
    if _explicit(config, "recompute_granularity"):
        return {}, (
            "selective recompute of core_attn with SDPA repeats the attention in backward and saves "
            "little memory (no score matrix is kept); model.recompute_granularity=None turns it off"
        )
    return {"recompute_granularity": None}, (
        "model.recompute_granularity=None: selective recompute covered only core_attn, and SDPA keeps no score matrix"
    )


def layer_problems(config: Any) -> list[ConfigProblem]:
    """What the layers this machine builds for `config` cannot run, found before they are built:
    context parallelism on local layers (neither SDPA nor DotProductAttention splits attention
    over context-parallel ranks; megatron-core would stop with an assertion)."""
    cp = config.context_parallel_size
    if cp == 1 or config.transformer_layer_spec is not None or te_layers(config):
        return []
    why = (
        "TransformerEngine is not installed"
        if config.transformer_impl == "transformer_engine"
        else f"transformer_impl={config.transformer_impl!r}"
    )
    return [
        ConfigProblem(
            "model.context_parallel_size",
            f"{cp} needs TransformerEngine layers; local layers ({why}) do not split attention over context-parallel ranks",
            "install TransformerEngine (the 'te' extra) and use transformer_impl='transformer_engine', or set model.context_parallel_size=1",
        )
    ]
