"""The dense 16-bit peak throughput of GPUs, by the name CUDA reports: what the training logs
measure FLOPs utilization against and what the planner estimates step times with."""

from __future__ import annotations

from typing import Optional

# Dense 16-bit (bf16/fp16) tensor-core peak TFLOP/s per device, matched in order on
# torch.cuda.get_device_name(): more specific names first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("V100", 125.0),
)


def peak_tflops_for(device_name: str) -> Optional[float]:
    """Peak dense 16-bit TFLOP/s of a GPU by its name; None if it is not in `PEAK_TFLOPS`."""
    for key, tflops in PEAK_TFLOPS:
        if key in device_name:
            return tflops
    return None
