"""The PEFT methods a run can use: `LoRA` and `DoRA`, the values of `ConfigContainer.peft`.

They are plain config sections (YAML round trip, overrides such as `peft.dim=32`, `--help-config
peft`); `peft=lora` / `peft=dora` on the command line creates one with the defaults. What they do
to the model lives in `megatron_bridge.peft.apply`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import POSITIVE, SIZE, field, parse
from megatron_bridge.peft.targets import pattern_problem

DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""megatron-core's four projections of a transformer layer (attention in/out, MLP in/out)."""

InitMethod = Literal["xavier", "kaiming", "normal", "zero"]


@config_dataclass(kw_only=True)
class LoRA(ConfigBase):
    """Low-rank adapters (LoRA) on linear layers, whose weights stay frozen.

    Each target layer W computes W x + (alpha / dim) * B @ A @ x with trainable A and B."""

    config_name: ClassVar[str] = "lora"
    """The name that selects this method on the command line (`peft=lora`)."""

    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Linear layers to adapt: a module name (`linear_qkv`, `linear_proj`, `linear_fc1`,
    `linear_fc2`, also inside MoE experts; multi-latent attention has `linear_q_proj` or
    `linear_q_down_proj` and `linear_q_up_proj`, `linear_kv_down_proj` and `linear_kv_up_proj` in
    place of `linear_qkv`) or a full-name pattern with wildcards, e.g. `*.layers.0.*.linear_qkv` or
    `*.experts.*.linear_fc1` (layer and expert numbers are global)."""

    dim: int = field(32, range=parse(SIZE, below="the rank must be positive"))
    """Rank of the update (the inner size of B @ A)."""

    alpha: float = field(32, range=parse(POSITIVE, below="must be positive"))
    """Scale numerator: the update is multiplied by alpha / dim."""

    dropout: float = field(0.0, range="[0, 1)")
    """Dropout probability on the adapter path (0: none)."""

    dropout_position: Literal["pre", "post"] = "pre"
    """Where the adapter's dropout acts: on its input ('pre') or on its output ('post')."""

    lora_A_init_method: InitMethod = "xavier"
    """Initialization of A (the down projection)."""

    lora_B_init_method: InitMethod = "zero"
    """Initialization of B (the up projection); 'zero' makes the adapted model start as its base."""

    @property
    def scale(self) -> float:
        """alpha / dim: the factor applied to B @ A."""
        return self.alpha / self.dim

    def _finalize(self, problems: Problems) -> None:
        p = problems
        if p.check(
            bool(self.target_modules),
            "target_modules",
            "is empty: nothing would be trained",
            f"use e.g. {list(DEFAULT_TARGETS)}",
        ):
            for i, pattern in enumerate(self.target_modules):
                why = pattern_problem(pattern)
                p.check(
                    why is None,
                    f"target_modules.{i}",
                    f"{pattern!r}: {why}",
                    "use a module name or a dotted pattern with * wildcards",
                )

    @property
    def method_name(self) -> str:
        return "DoRA" if isinstance(self, DoRA) else "LoRA"


@config_dataclass(kw_only=True)
class DoRA(LoRA):
    """Weight-decomposed low-rank adaptation (DoRA) on linear layers, whose weights stay frozen.

    Each target weight becomes m * V / ||V|| (norms per output row) with V = W + (alpha / dim) * B @ A
    and a trainable magnitude m per output feature (initialized to the rows' norms)."""

    config_name: ClassVar[str] = "dora"
    """The name that selects this method on the command line (`peft=dora`)."""
