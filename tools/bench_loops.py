"""The two training loops that `bench_pretrain.py` compares, run one per process.

    python tools/bench_loops.py handwritten|pretrain ITERS

Both train the same tiny GPT (2 layers, hidden 64, 4 heads, vocab 256, seq 32; global batch 8
as 2 micro batches of 4; Adam with a cosine schedule; mock data) and print one JSON line: seconds
from process start to the end of the first iteration, and the duration of every iteration.
The hand-written loop uses megatron-core directly; on a CPU machine it needs the same CPU
backend as pretrain() (megatron-core cannot run on CPU without it).
"""

from __future__ import annotations

import json
import os
import sys
import time

import psutil

SEQ, VOCAB, MBS, GBS, LAYERS, HIDDEN, HEADS = 32, 256, 4, 8, 2, 64, 4


def since_start() -> float:
    return time.time() - psutil.Process().create_time()


def handwritten(iters: int) -> dict:
    from functools import partial

    import torch
    import torch.distributed as dist

    import megatron_bridge  # noqa: F401  (same warning filters as pretrain)
    from megatron_bridge.runtime import cpu_backend
    from megatron_bridge.runtime.distributed import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    cpu_backend.activate()

    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bridge.runtime.tokenizers.tokenizer import NullTokenizer

    parallel_state.initialize_model_parallel()
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local",
    )  # fmt: skip
    gpt = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=SEQ, position_embedding_type="rope",
    )  # fmt: skip
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=gpt)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-3, min_lr=3e-4), [model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2 * GBS, lr_decay_steps=iters * GBS,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=iters * GBS, wd_incr_style="constant",
    )  # fmt: skip
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads

    data_config = GPTDatasetConfig(
        random_seed=1234, sequence_length=SEQ, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, tokenizer=NullTokenizer(VOCAB), split="1,0,0",
    )  # fmt: skip
    train_ds, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [iters * GBS, None, None], lambda: True, data_config).build()
    loader = torch.utils.data.DataLoader(train_ds, batch_size=MBS, shuffle=False, num_workers=0, drop_last=True)
    batches = iter(loader)

    def loss_func(loss_mask, output):
        mask = loss_mask.view(-1).float()
        loss = torch.sum(output.float().view(-1) * mask)
        tokens = mask.sum().to(torch.int)
        return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1).float()])}

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        return out, partial(loss_func, b["loss_mask"])

    fwd_bwd = get_forward_backward_func()
    times, first = [], None
    for _ in range(iters):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        fwd_bwd(forward_step_func=forward_step, data_iterator=batches, model=[model], num_microbatches=GBS // MBS,
                seq_length=SEQ, micro_batch_size=MBS, decoder_seq_length=SEQ, forward_only=False)  # fmt: skip
        ok, _, _ = optimizer.step()
        if ok:
            scheduler.step(increment=GBS)
        times.append(time.perf_counter() - start)
        if first is None:
            first = since_start()
    return {"first_iteration_end": first, "iteration_times": times}


def with_pretrain(iters: int) -> dict:
    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.training.callbacks import Callback
    from megatron_bridge.training.config import (
        ConfigContainer,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        SchedulerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    class Timing(Callback):
        def __init__(self):
            self.times, self.first, self.start = [], None, 0.0

        def on_step_start(self, state):
            self.start = time.perf_counter()

        def on_step_end(self, state, metrics):
            self.times.append(time.perf_counter() - self.start)
            if self.first is None:
                self.first = since_start()

    cfg = ConfigContainer(
        model=GPTModelProvider(
            num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ, vocab_size=VOCAB,
            position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local",
            share_embeddings_and_output_weights=True,
        ),  # fmt: skip
        train=TrainingConfig(train_iters=iters, global_batch_size=GBS, micro_batch_size=MBS),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=2),
        dataset=MockGPTDatasetConfig(seq_length=SEQ, num_workers=0, split="1,0,0"),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        validation=ValidationConfig(eval_iters=0),
        logger=LoggerConfig(log_interval=10),
    )
    timing = Timing()
    pretrain(cfg, forward_step, callbacks=[timing])
    return {"first_iteration_end": timing.first, "iteration_times": timing.times}


if __name__ == "__main__":
    kind, iters = sys.argv[1], int(sys.argv[2])
    result = handwritten(iters) if kind == "handwritten" else with_pretrain(iters)
    print("BENCH " + json.dumps(result), flush=True)
