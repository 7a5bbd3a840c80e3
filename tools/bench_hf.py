"""Hugging Face import/export against the direct way of doing the same I/O, side by side in one run.

    python tools/bench_hf.py [--family llama|deepseek] [--layers 8] [--keep DIR]

Builds a random model of about 1 GB (bf16, 4 safetensors shards with an index) of the Llama
architecture, or of DeepSeek-V3's (`--family deepseek`: multi-latent attention, the first layer
dense, then 32 routed experts and a shared one per layer, the expert bias in fp32), then
measures, each phase in a fresh process after its imports, best of `--repeat`:

* import: `import_hf` (1 process: build the model, read every slice, convert, write our
  checkpoint) against reading all safetensors with `safetensors.torch.load_file` and writing
  them with `dist_checkpointing.save` directly; speed = direct time / import time (goal >= 0.7);
* memory: `mbridge hf import --tp 2` under torchrun: each rank's peak RSS above its RSS before
  the import, as a fraction of the model size (goal <= 0.6);
* export: `write_hf_weights` of the loaded model (gather, convert, sharded files, index,
  config.json) against `safetensors.torch.save_file` of the same tensors in the same shards, in
  alternating order; speed = direct time / export time (goal >= 0.7), best runs and the median
  of the paired runs.

Every timed run starts with its output removed and dirty pages flushed (`os.sync`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def clean_slate(path: str) -> None:
    """Remove `path` and flush dirty pages, so a timed write does not pay for the previous one's."""
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1e6


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


# ---------------------------------------------------------------------- the model
FAMILIES = {
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
        "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 4,
    },
    "deepseek": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 32000,
        "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": 384, "kv_lora_rank": 256, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 512, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "num_nextn_predict_layers": 0,
    },
}  # fmt: skip
"""config.json of each family (without the layer count): about 1 GB of bf16 weights at 8 layers."""


def make_model(directory: str, layers: int, family: str = "llama") -> int:
    """A random bf16 model of `family` in 4 shards (a DeepSeek expert bias in fp32, as published);
    returns its size in bytes."""
    import torch
    from safetensors.torch import save_file

    from megatron_bridge.models.hf.load import expected_weights

    config = {
        **FAMILIES[family], "num_hidden_layers": layers, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    _, expected, _ = expected_weights(config)

    def dtype_of(name: str):
        return torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16

    def nbytes(name: str, shape) -> int:
        return _numel(shape) * (4 if dtype_of(name) == torch.float32 else 2)

    total = sum(nbytes(n, s) for n, s in expected.items())
    shards, current, size, limit = [], {}, 0, total // 4 + 1
    generator = torch.Generator().manual_seed(0)
    for name, shape in expected.items():
        current[name] = (torch.randn(shape, generator=generator) * 0.02).to(dtype_of(name))
        size += nbytes(name, shape)
        if size >= limit:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------- phases (fresh processes)
def phase_direct_import(hf_dir: str, out: str) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from safetensors.torch import load_file

    from megatron_bridge.runtime import cpu_backend
    from megatron_bridge.runtime.distributed import free_port

    start = time.perf_counter()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    cpu_backend.activate()  # dist_checkpointing synchronizes CUDA while saving (a no-op on GPUs)
    tensors = {}
    for file in sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(hf_dir, file)))
    sd = {name: ShardedTensor.from_rank_offsets(name, t, replica_id=0) for name, t in tensors.items()}
    os.makedirs(out)
    dist_checkpointing.save(sd, out, TorchDistSaveShardedStrategy("torch_dist", 1))
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return {"seconds": seconds}


def phase_import(hf_dir: str, out: str) -> dict:
    # imports first, as the direct phase does
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import torch.distributed  # noqa: F401

    from megatron_bridge.models.hf import convert, load, runtime  # noqa: F401

    before = rss_mb()
    start = time.perf_counter()
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    convert.import_hf(hf_dir, out, tp=tp)
    return {"seconds": time.perf_counter() - start, "rss_before_mb": before, "peak_mb": peak_mb(),
            "rank": int(os.environ.get("RANK", "0"))}  # fmt: skip


def phase_export(hf_dir: str, ckpt: str, out: str, repeat: int) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_bridge.models.hf import convert
    from megatron_bridge.models.hf.runtime import build_chunks, load_checkpoint_weights, model_parallel, prepare
    from megatron_bridge.models.hf.writer import write_hf_weights
    from megatron_bridge.runtime.checkpointing.layout import resolve

    directory = resolve(ckpt)[0]
    provider = convert.checkpoint_provider(directory)
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))["weight_map"]
    shards: dict[str, dict] = {}
    for file in sorted(set(index.values())):
        shards[file] = load_file(os.path.join(hf_dir, file))
    shard_bytes = max(sum(t.numel() * t.element_size() for t in s.values()) for s in shards.values())
    ours, direct = [], []
    with model_parallel() as device:
        chunks = build_chunks(prepare(provider, device, params_dtype=torch.bfloat16, bf16=False), device)
        load_checkpoint_weights(chunks, directory)
        hf, dtype = convert.export_config(chunks[0].config, convert.hf_origin(directory), "bf16")
        def run_direct():
            os.makedirs(out)
            for file, tensors in shards.items():
                save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})

        def run_ours():
            write_hf_weights(chunks, out, hf, dtype, max_shard_bytes=shard_bytes)

        for i in range(repeat):  # alternating which goes first
            for fn, times in ((run_direct, direct), (run_ours, ours))[:: 1 if i % 2 == 0 else -1]:
                clean_slate(out)
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
    return {"ours": ours, "direct": direct, "files": len(os.listdir(out))}


def run_phase(*args: str, torchrun: bool = False) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    results = tempfile.mkdtemp(prefix="bench_hf_results_")
    env["BENCH_HF_RESULTS"] = results  # one file per process: their stdout lines would interleave
    if torchrun:
        from megatron_bridge.runtime.distributed import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", __file__, *args]  # fmt: skip
    else:
        cmd = [sys.executable, __file__, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return [json.load(open(os.path.join(results, f))) for f in sorted(os.listdir(results))]
    finally:
        shutil.rmtree(results, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama", help="the model's architecture")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (8: about 1 GB in bf16)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each timed phase; the best counts")
    p.add_argument("--export-repeat", type=int, default=9, help="runs of each export (writes are fast and noisy)")
    p.add_argument("--keep", help="work in this directory and keep it (default: a temporary one)")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--args", nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        import warnings

        warnings.filterwarnings("ignore")
        result = {"direct-import": phase_direct_import, "import": phase_import, "export": phase_export}[args.phase]
        extra = [int(a) if a.isdigit() else a for a in args.args]
        value = result(*extra)
        with open(os.path.join(os.environ["BENCH_HF_RESULTS"], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(value, f)
        return
    work = args.keep or tempfile.mkdtemp(prefix="bench_hf_")
    try:
        hf_dir = os.path.join(work, "hf")
        shutil.rmtree(hf_dir, ignore_errors=True)
        size = make_model(hf_dir, args.layers, args.family)
        mb = size / 1e6
        print(f"model: {FAMILIES[args.family]['architectures'][0]}, {args.layers} layers, {mb:.0f} MB of bf16 weights "
              "in 4 safetensors shards")  # fmt: skip
        ours, direct = [], []
        phases = (("direct-import", "direct", direct), ("import", "ours", ours))
        for i in range(args.repeat):  # alternating which goes first
            for name, target, bucket in phases[:: 1 if i % 2 == 0 else -1]:
                out = os.path.join(work, target)
                clean_slate(out)
                bucket.append(run_phase("--phase", name, "--args", hf_dir, out)[0]["seconds"])
        shutil.rmtree(os.path.join(work, "direct"), ignore_errors=True)
        ckpt = os.path.join(work, "ours")
        print(f"import, 1 process:  ours {min(ours):.2f} s, direct read + dist_checkpointing.save {min(direct):.2f} s "
              f"-> speed {min(direct) / min(ours):.2f}x of direct (goal >= 0.7)")  # fmt: skip
        ranks = run_phase("--phase", "import", "--args", hf_dir, os.path.join(work, "tp2"), torchrun=True)
        for r in sorted(ranks, key=lambda r: r["rank"]):
            grown = r["peak_mb"] - r["rss_before_mb"]
            print(f"import, TP=2 rank {r['rank']}: {r['seconds']:.2f} s, peak RSS {r['peak_mb']:.0f} MB = interpreter "
                  f"{r['rss_before_mb']:.0f} MB + {grown:.0f} MB = {grown / mb:.2f}x the model (goal <= 0.6)")  # fmt: skip
        shutil.rmtree(os.path.join(work, "tp2"), ignore_errors=True)
        export = run_phase("--phase", "export", "--args", hf_dir, ckpt, os.path.join(work, "exported"), str(args.export_repeat))[0]
        ours, direct = export["ours"], export["direct"]
        paired = sorted(d / o for d, o in zip(direct, ours))
        print(f"export, 1 process:  ours {min(ours):.2f} s, direct safetensors save_file {min(direct):.2f} s (best of "
              f"{len(ours)}) -> speed {min(direct) / min(ours):.2f}x of direct; median of paired runs "
              f"{paired[len(paired) // 2]:.2f}x (goal >= 0.7)")  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
