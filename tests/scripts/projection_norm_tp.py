"""Under torchrun with 2 processes (TP=2): the whole-projection qk norm on each rank's heads gives
the forward values and the input and weight gradients of the norm computed over all heads in one
process. Exits non-zero with the largest difference when they differ. `hf_logits.py
--check-projection-norm` runs it after the OLMo 2 logits, in the same processes.

    torchrun --nproc_per_node=2 tests/scripts/projection_norm_tp.py
"""

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_bridge.models.layers.projection_norm import ProjectionNorm

HEADS, GROUPS, SIZE, EPS = 4, 2, 8, 1e-6


def reference(x, weight, upstream):
    """The norm over all heads in one process, and the gradients of sum(upstream * norm(x))."""
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    flat = x.reshape(*x.shape[:2], -1)
    y = (weight * (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS))).reshape(x.shape)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, weight.grad


def check_projection_norm():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    config = SimpleNamespace(num_attention_heads=HEADS, num_query_groups=GROUPS)
    worst = 0.0
    for which, heads in (("query", HEADS), ("key", GROUPS)):
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(5, 3, heads, SIZE, generator=gen, dtype=torch.float64).to(device)
        weight = (1 + 0.3 * torch.randn(heads * SIZE, generator=gen, dtype=torch.float64)).to(device)
        upstream = torch.randn(5, 3, heads, SIZE, generator=gen, dtype=torch.float64).to(device)
        y_ref, dx_ref, dw_ref = reference(x, weight, upstream)

        local = heads // 2
        norm = ProjectionNorm(config, SIZE, EPS, which).double().to(device)
        with torch.no_grad():
            norm.weight.copy_(weight[rank * local * SIZE : (rank + 1) * local * SIZE])
        mine = x[:, :, rank * local : (rank + 1) * local].clone().requires_grad_()
        y = norm(mine)
        (y * upstream[:, :, rank * local : (rank + 1) * local]).sum().backward()
        part = slice(rank * local, (rank + 1) * local)
        diffs = [
            (y - y_ref[:, :, part]).abs().max().item(),
            (mine.grad - dx_ref[:, :, part]).abs().max().item(),
            (norm.weight.grad - dw_ref[rank * local * SIZE : (rank + 1) * local * SIZE]).abs().max().item(),
        ]
        assert norm.weight.tensor_model_parallel and norm.weight.partition_dim == 0
        worst = max(worst, *diffs)
        print(f"rank {rank} {which}: forward {diffs[0]:.2e}, input grad {diffs[1]:.2e}, weight grad {diffs[2]:.2e}")
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
    if worst > 1e-5:  # the norm computes in fp32, as Hugging Face RMSNorms do; a wrong sum is off by O(1)
        sys.exit(f"rank {rank}: largest difference {worst:.3e}")


if __name__ == "__main__":
    check_projection_norm()
