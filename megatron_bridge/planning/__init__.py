"""The planner: memory per GPU, fit, time and layout of a config before any GPU is used.

    from megatron_bridge.planning import plan
    runtime_config_update(cfg, world_size=64)
    p = plan(cfg, gpu="h100-80gb", mfu=0.4)
    print("\\n".join(p.text()))

A pure function of the resolved config: no GPU is touched and no model is built.
"""

from megatron_bridge.planning.devices import DEFAULT_GPU, GPUS
from megatron_bridge.planning.inputs import PlanInputs, PlanningError
from megatron_bridge.planning.plan import Plan, plan
from megatron_bridge.planning.timing import DEFAULT_MFU

__all__ = ["DEFAULT_GPU", "DEFAULT_MFU", "GPUS", "Plan", "PlanInputs", "PlanningError", "plan"]
