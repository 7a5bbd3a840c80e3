"""Core attention of one layer, forward + backward: SDPA (`SDPAttention`) against megatron-core's
unfused local `DotProductAttention`, side by side at a few sequence lengths.

    python tools/bench_attention.py [--seq 512 1024 2048] [--heads 16] [--groups 4] [--head-dim 64]
                                    [--batch 1] [--repeats 5] [--window N] [--dtype fp32|bf16]
                                    [--softmax-type vanilla|off-by-one|learnable]

Same query/key/value tensors ([s, b, heads, d], grouped-query key/value) into both modules,
alternating; prints per length the median time of each (ms), unfused/SDPA, and the largest
difference of the outputs and of the query gradients. Runs on the GPU when there is one (bf16 by default there),
else on CPU (fp32) with the CPU backend, in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=int, default=None, help="sliding window (left) for both")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None)
    parser.add_argument("--softmax-type", choices=("vanilla", "off-by-one", "learnable"), default="vanilla",
                        help="attention sinks: none, a zero logit, or a learned logit per head (the same in both)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    import megatron_bridge  # noqa: F401  (warning filters)
    from megatron_bridge.runtime import cpu_backend
    from megatron_bridge.runtime.distributed import free_port

    cuda = torch.cuda.is_available()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if cuda else "fp32")]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    else:
        cpu_backend.activate()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.models.attention_masks import WindowedDotProductAttention
    from megatron_bridge.models.sdpa_attention import SDPAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    device = torch.device("cuda" if cuda else "cpu")
    h, g, d, b = args.heads, args.groups, args.head_dim, args.batch
    print(f"core attention fwd+bwd on {'GPU ' + torch.cuda.get_device_name() if cuda else 'CPU'} ({torch.get_num_threads()} threads), "
          f"{str(dtype).replace('torch.', '')}, batch {b}, {h} heads, {g} groups, head dim {d}, "
          f"window {args.window}, softmax {args.softmax_type}, median of {args.repeats}")  # fmt: skip
    print(f"{'seq':>6} {'unfused ms':>11} {'sdpa ms':>9} {'unfused/sdpa':>13} {'max |out diff|':>15} {'max |dq diff|':>14}")
    for s in args.seq:
        config = GPTModelProvider(
            num_layers=1, hidden_size=h * d, num_attention_heads=h, num_query_groups=g, seq_length=s,
            attention_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype,
            window_size=(args.window, 0) if args.window else None, softmax_type=args.softmax_type,
            **({} if cuda else cpu_backend.CPU_MODEL_SETTINGS),
        )  # fmt: skip
        config.finalize()
        unfused_cls = WindowedDotProductAttention if args.window else DotProductAttention
        modules = {
            "unfused": unfused_cls(config, 1, AttnMaskType.causal, "self"),
            "sdpa": SDPAttention(config, 1, AttnMaskType.causal, "self"),
        }
        if args.softmax_type == "learnable":
            with torch.no_grad():
                modules["sdpa"].softmax_offset.copy_(modules["unfused"].softmax_offset)
        gen = torch.Generator(device="cpu").manual_seed(s)
        q0 = torch.randn(s, b, h, d, generator=gen).to(device, dtype)
        k0 = torch.randn(s, b, g, d, generator=gen).to(device, dtype)
        v0 = torch.randn(s, b, g, d, generator=gen).to(device, dtype)
        grad = torch.randn(s, b, h * d, generator=gen).to(device, dtype)
        runs, results = {name: [] for name in modules}, {}
        for repeat in range(args.repeats + 1):  # alternating, so load changes hit both alike
            for name, module in modules.items():
                q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = module(q, k, v, None)
                out.backward(grad)
                if cuda:
                    torch.cuda.synchronize()
                if repeat:  # the first is a warm-up
                    runs[name].append(time.perf_counter() - start)
                results[name] = (out.detach().float().cpu(), q.grad.float().cpu())
        times = {name: statistics.median(values) * 1e3 for name, values in runs.items()}
        out_diff = (results["unfused"][0] - results["sdpa"][0]).abs().max().item()
        dq_diff = (results["unfused"][1] - results["sdpa"][1]).abs().max().item()
        ratio = times["unfused"] / times["sdpa"]
        print(f"{s:>6} {times['unfused']:>11.2f} {times['sdpa']:>9.2f} {ratio:>12.2f}x {out_diff:>15.2e} {dq_diff:>14.2e}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
