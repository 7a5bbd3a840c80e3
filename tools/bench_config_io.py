"""Benchmark: applying 50 CLI overrides, and the YAML round trip, on an 8B-Llama-shaped config.

    python tools/bench_config_io.py [--repeat 20]

Prints, for each measurement, the first call in this process (cold: includes the per-type caches
being filled, which is what one `mbridge` invocation pays) and the median of `--repeat` further
calls (warm), with their ratios to the goals of docs/design.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

OVERRIDES_TARGET_MS, OVERRIDES_GOAL_MS, ROUND_TRIP_GOAL_MS = 50.0, 10.0, 30.0

OVERRIDES = [
    "train.train_iters=1000",
    "train.global_batch_size=256",
    "train.micro_batch_size=2",
    "train.exit_signal_handler=true",
    "train.exit_signal=SIGINT",
    "train.manual_gc=true",
    "train.manual_gc_interval=100",
    "train.rampup_batch_size=[32,32,1000]",
    "train.rampup_batch_size.0=16",
    "validation.eval_interval=500",
    "validation.eval_iters=10",
    "~validation.test_iters",
    "optimizer.lr=3e-4",
    "optimizer.min_lr=3e-5",
    "optimizer.weight_decay=0.1",
    "optimizer.adam_beta2=0.95",
    "optimizer.clip_grad=1.0",
    "scheduler.lr_warmup_iters=100",
    "scheduler.lr_decay_style=cosine",
    "scheduler.lr_decay_iters=1000",
    "model.num_layers=16",
    "model.hidden_size=2048",
    "model.ffn_hidden_size=8192",
    "model.num_attention_heads=16",
    "model.num_query_groups=4",
    "model.seq_length=4096",
    "model.params_dtype=bf16",
    "model.pipeline_dtype=bfloat16",
    "model.activation_func=silu",
    "model.attention_backend=flash",
    "model.tensor_model_parallel_size=2",
    "model.pipeline_model_parallel_size=2",
    "model.sequence_parallel=true",
    "model.recompute_granularity=selective",
    "model.rotary_base=500000",
    "model.init_method_std=0.02",
    "dataset.seq_length=4096",
    "dataset.num_workers=4",
    "dataset.random_seed=42",
    "checkpoint.save=/tmp/ckpt",
    "checkpoint.save_interval=500",
    "checkpoint.most_recent_k=3",
    "logger.log_interval=10",
    "logger.wandb_project=bench",
    "logger.comet_tags=[a,b,c]",
    "logger.comet_tags.1=x",
    "++logger.mlflow_tags={team:llm}",
    "++env_vars={NCCL_DEBUG:WARN}",
    "+env_vars.CUDA_DEVICE_MAX_CONNECTIONS=1",
    "rng.seed=7",
]


def build_config():
    """The 8B Llama recipe if the recipe library has it, else an equivalent hand-built config."""
    try:
        from recipes import get_recipe

        return get_recipe("llama3_8b_pretrain_config")(), "recipes.llama3_8b_pretrain_config"
    except (ImportError, KeyError):
        pass
    import torch

    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.training.config import (
        ConfigContainer,
        MockGPTDatasetConfig,
        OptimizerConfig,
        SchedulerConfig,
        TrainingConfig,
    )
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    model = GPTModelProvider(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        seq_length=8192,
        vocab_size=128256,
        position_embedding_type="rope",
        rotary_base=500000,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        share_embeddings_and_output_weights=False,
        tensor_model_parallel_size=1,
    )
    cfg = ConfigContainer(
        train=TrainingConfig(train_iters=1168251, global_batch_size=512, micro_batch_size=1),
        model=model,
        optimizer=OptimizerConfig(lr=3e-4, min_lr=3e-5, weight_decay=0.1, adam_beta2=0.95),
        scheduler=SchedulerConfig(lr_warmup_iters=2000),
        dataset=MockGPTDatasetConfig(seq_length=8192),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128256),
        mixed_precision="bf16_mixed",
    )
    return cfg, "hand-built 8B Llama ConfigContainer"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(repeat: int) -> tuple[list[float], list[float]]:
    """Milliseconds of each call, the first one cold: (50 overrides, YAML round trip)."""
    from megatron_bridge.training.config import ConfigContainer
    from megatron_bridge.config.serialization import from_yaml, to_yaml
    from megatron_bridge.config.overrides import process_config_with_overrides

    base, _ = build_config()
    if len(OVERRIDES) != 50:
        raise SystemExit(f"expected 50 overrides, have {len(OVERRIDES)}")
    copies = [copy.deepcopy(base) for _ in range(repeat + 1)]
    override_ms = [timed(lambda c=c: process_config_with_overrides(c, cli_overrides=OVERRIDES)) for c in copies]

    path = os.path.join(tempfile.mkdtemp(), "config.yaml")
    loaded = []

    def round_trip() -> None:
        to_yaml(base, path)
        loaded.append(from_yaml(path, ConfigContainer))

    trip_ms = [timed(round_trip) for _ in range(repeat + 1)]
    if not all(c == base for c in loaded):
        raise SystemExit("round trip changed the config")
    return override_ms, trip_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    from megatron_bridge.config.serialization import to_yaml

    base, source = build_config()
    override_ms, trip_ms = measure(args.repeat)

    def report(what: str, samples: list[float], goal: float, target: float | None = None) -> None:
        cold, warm = samples[0], statistics.median(samples[1:])
        extra = f", target < {target:.0f} ms" if target else ""
        print(f"{what} (goal <= {goal:.0f} ms{extra}):")
        print(f"  first call  {cold:7.2f} ms   ratio to goal {cold / goal:.2f}")
        print(f"  median of {len(samples) - 1:<3d}{warm:7.2f} ms   ratio to goal {warm / goal:.2f}")

    print(f"config: {source}; {len(to_yaml(base).splitlines())} YAML lines")
    report("apply 50 CLI overrides", override_ms, OVERRIDES_GOAL_MS, OVERRIDES_TARGET_MS)
    report("to_yaml + from_yaml round trip", trip_ms, ROUND_TRIP_GOAL_MS)


if __name__ == "__main__":
    main()
