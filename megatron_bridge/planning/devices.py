"""The GPUs a plan can target: memory and dense 16-bit peak throughput."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bridge.runtime.gpu_peaks import peak_tflops_for


@dataclass(frozen=True)
class GPU:
    """A GPU model as the planner sees it."""

    key: str
    """Name on the command line (`--gpu`)."""
    name: str
    """Marketing name, also the key into the peak-throughput table."""
    memory_bytes: int
    """Device memory as the CUDA driver reports it (`total_memory`), approximately."""

    @property
    def peak_flops(self) -> float:
        """Dense bf16/fp16 tensor-core peak, FLOP/s."""
        return peak_tflops_for(self.name) * 1e12


GPUS: dict[str, GPU] = {
    g.key: g
    for g in (
        GPU("h100-80gb", "H100 80GB", 85_520_809_984),
        GPU("h200-141gb", "H200 141GB", 150_754_820_096),
        GPU("a100-80gb", "A100 80GB", 85_174_583_296),
        GPU("b200-180gb", "B200 180GB", 191_537_463_296),
    )
}
"""Every `--gpu` choice."""

DEFAULT_GPU = "h100-80gb"


def get_gpu(key: str) -> GPU:
    """The GPU named `key` (one of `GPUS`); a ValueError listing the choices otherwise."""
    try:
        return GPUS[key]
    except KeyError:
        raise ValueError(f"unknown GPU {key!r}; choose one of {', '.join(GPUS)}") from None
