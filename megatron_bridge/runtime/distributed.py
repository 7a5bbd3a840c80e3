"""Process groups: create them (or join the launcher's), set up megatron-core parallel state,
and tear down — or abort, so a failing rank does not leave the others hanging."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.runtime.launcher_env import launcher_int

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer

logger = logging.getLogger(__name__)


def resolve_backend(requested: str) -> str:
    """`auto` -> nccl when CUDA is available, else gloo."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


def launch_problem(
    visible_gpus: int,
    local_rank: int,
    local_world_size: int,
    backend: str,
    gpu_per_process: bool = False,
    setting: str = "dist.distributed_backend",
) -> Optional[ConfigProblem]:
    """Why a process launched this way cannot train with `backend` (auto, nccl or gloo) on a
    machine with `visible_gpus` GPUs, or None.

    NCCL puts each process on the GPU of its local rank, so a machine needs as many visible GPUs
    as it runs processes. `gpu_per_process`: the launcher gave each process only its own GPU
    (`dist.external_gpu_device_mapping`), so one visible GPU is enough. `setting` is where the
    caller's users choose the backend (the problem's path; `setting=gloo` trains on CPU).
    """
    if backend == "gloo" or (backend == "auto" and visible_gpus < 1):
        return None
    shown = "nccl" if backend == "nccl" else "auto (nccl where GPUs are visible)"
    if gpu_per_process and visible_gpus >= 1:
        return None
    processes = f"{local_world_size} process{'es' if local_world_size != 1 else ''}"
    gpus = f"{visible_gpus} visible GPU{'s' if visible_gpus != 1 else ''}"
    on_gpus = (
        f"launch one process per GPU (torchrun --nproc_per_node={visible_gpus})" if visible_gpus else "run where GPUs are visible"
    )
    way_out = f"{on_gpus}, or set {setting}=gloo to train on CPU"
    if local_world_size > visible_gpus or visible_gpus < 1:
        return ConfigProblem(
            setting,
            f"{shown} needs one GPU per process, but this machine runs {processes} (LOCAL_WORLD_SIZE) "
            f"and has {gpus} (torch.cuda.device_count())",
            way_out,
        )
    if local_rank >= visible_gpus:
        return ConfigProblem(
            setting,
            f"{shown} puts each process on the GPU of its local rank, but local rank {local_rank} is past "
            f"the {gpus} (devices 0 to {visible_gpus - 1})",
            way_out,
        )
    return None


def checked_backend(
    requested: str, local_rank: int, gpu_per_process: bool = False, setting: str = "dist.distributed_backend"
) -> str:
    """The backend (nccl or gloo) this process uses for `requested` (auto, nccl or gloo); raises
    `ConfigValidationError` when this launch cannot use it on this machine (`launch_problem`,
    with the local world size torchrun gives)."""
    local_world = launcher_int("LOCAL_WORLD_SIZE", 1)
    problem = launch_problem(
        torch.cuda.device_count(), local_rank, local_world, requested, gpu_per_process, setting
    )
    if problem is not None:
        raise ConfigValidationError(problem)
    return resolve_backend(requested)


def run_backend(dist_config) -> str:
    """`checked_backend` of a training run's `dist` settings."""
    return checked_backend(
        dist_config.distributed_backend, cuda_device_index(dist_config), dist_config.external_gpu_device_mapping
    )


def free_port(count: int = 1) -> int:
    """A loopback port that is free now, with the `count - 1` ports after it free as well (a
    launcher's store and the ones numbered from it)."""
    for _ in range(100):
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                for offset in range(1, count):
                    after = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    after.bind(("127.0.0.1", port + offset))
            except OSError:  # taken, or past the last port: try another
                continue
            return port
    raise OSError(f"no {count} consecutive free loopback ports found")


def single_process_store() -> dist.Store:
    """The rendezvous store of a 1-process group: in memory, so no port is opened (a free port
    picked, then bound, can be taken in between by another process doing the same) and no
    launcher variables are left for child processes to inherit."""
    return dist.HashStore()


def cpu_threads(world_size: int) -> int:
    """Intra-op threads of a CPU run: OMP_NUM_THREADS when set (torchrun sets 1 per process
    unless told otherwise), else this machine's cores shared among its local processes."""
    wanted = os.environ.get("OMP_NUM_THREADS", "").strip()
    if wanted.isdigit() and int(wanted) > 0:
        return int(wanted)
    local_world = launcher_int("LOCAL_WORLD_SIZE", world_size)
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


def cuda_device_index(dist_config) -> int:
    """The GPU this process trains on: its local rank (`dist.local_rank`, else LOCAL_RANK), or 0
    when the launcher already gave each process only its own GPU (`external_gpu_device_mapping`)."""
    if dist_config.external_gpu_device_mapping:
        return 0
    if dist_config.local_rank is not None:
        return dist_config.local_rank
    return launcher_int("LOCAL_RANK", 0)


def init_process_group(cfg: "ConfigContainer", store: Optional[dist.Store] = None) -> tuple[str, bool]:
    """Join the launcher's process group (torchrun) or create a 1-process one; with `store`
    (in-process restart), rendezvous through it.

    Returns (device, created): device is "cuda" or "cpu"; created tells whether this call made
    the group (and so the caller must destroy it).
    """
    if os.environ.get("LOCAL_RANK", "").strip() == "-1":
        # "not one of several processes" to the tools that export it; torch would take it as a
        # device index (its NCCL barrier and device meshes read LOCAL_RANK themselves)
        del os.environ["LOCAL_RANK"]
    backend = run_backend(cfg.dist)
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(cuda_device_index(cfg.dist))
    if dist.is_initialized():
        if dist.get_backend() != backend:
            logger.warning("using the existing %s process group (config asks for %s)", dist.get_backend(), backend)
        return device, False
    if "RANK" not in os.environ:
        rank, world_size = 0, 1
        store = store if store is not None else single_process_store()
    else:
        rank, world_size = launcher_int("RANK"), launcher_int("WORLD_SIZE")
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=cfg.dist.distributed_timeout_minutes),
        store=store,
    )
    return device, True


def init_model_parallel(cfg: "ConfigContainer") -> None:
    """megatron-core parallel state for TP/PP/VP/CP/EP and the data-parallel rest."""
    from megatron.core import parallel_state

    m = cfg.model
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
        context_parallel_size=m.context_parallel_size,
        hierarchical_context_parallel_sizes=m.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=m.expert_model_parallel_size,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size,
        num_distributed_optimizer_instances=cfg.ddp.num_distributed_optimizer_instances,
        nccl_communicator_config_path=cfg.dist.nccl_communicator_config_path,
        distributed_timeout_minutes=cfg.dist.distributed_timeout_minutes,
        order="tp-cp-ep-dp-pp" if not cfg.dist.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp",
        create_gloo_process_groups=cfg.dist.use_gloo_process_groups,
        high_priority_stream_groups=cfg.dist.high_priority_stream_groups,
        use_sharp=cfg.dist.use_sharp,
    )


def teardown(destroy_group: bool) -> None:
    """Release megatron-core globals; destroy the process group if we created it."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    destroy_rerun_state_machine()
    destroy_num_microbatches_calculator()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_group and dist.is_initialized():
        dist.destroy_process_group()


def abort() -> None:
    """After a failure on this rank: abort communication instead of waiting for peers that
    will never answer, so the other ranks fail fast instead of hanging."""
    from megatron.core import parallel_state

    try:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - best effort while failing
        pass
    if not dist.is_initialized():
        return
    abort_group = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort_group is not None:
            abort_group()
        else:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the group may already be broken
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
