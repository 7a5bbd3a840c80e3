"""Sequence packing: per-sample losses equal to unpacked ones, far fewer sequences, a cache that
is reused only for the same data and settings."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from factories import one_process_group, tiny_model
from text_data import documents, train_tokenizer

from megatron_bridge.data.packing import PackedSamples, PackedSFTDataset, block_causal_mask, pack, packed_dataset
from megatron_bridge.runtime import cpu_backend
from megatron_bridge.runtime.tokenizers.tokenizer import HuggingFaceTokenizer


def test_pack_places_every_sample_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 101, 500).tolist()
    bins = pack(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert len(bins) <= 1.1 * sum(lengths) / 100 + 1  # best-fit decreasing wastes little
    with pytest.raises(ValueError, match="item 3 has 101 tokens, more than the packed sequence size 100"):
        pack([5, 5, 5, 101], 100)


def test_packing_needs_at_most_half_the_sequences_on_mixed_lengths(tmp_path):
    tok = HuggingFaceTokenizer(train_tokenizer(tmp_path / "tok"))
    samples = []
    for text in documents(400, seed=5, sentences=(1, 8)):  # 1 to 8 sentences: 10 to ~110 tokens
        ids = np.array(tok.tokenize(text) + [tok.eod])
        samples.append((ids, np.ones(len(ids), dtype=np.uint8)))
    lengths = [len(ids) for ids, _ in samples]
    packed = PackedSamples.from_samples(samples, 256, seed=0)
    print(f"{len(samples)} samples of {min(lengths)}..{max(lengths)} tokens -> {len(packed)} packed sequences")
    assert len(packed) <= len(samples) / 2
    ds = PackedSFTDataset(packed, 256, len(packed), seed=0, pad_id=0)
    covered = sorted(int(i) for b in range(len(packed)) for i in packed.bin(b))
    assert covered == list(range(len(samples)))
    item = ds[0]
    first = packed.bin(0)
    n0 = len(samples[first[0]][0]) - 1
    assert item["tokens"][:n0].tolist() == samples[first[0]][0][:-1].tolist()
    assert item["position_ids"][n0] == 0 and item["position_ids"][n0 - 1] == n0 - 1  # positions restart per sample


def test_block_causal_mask_keeps_attention_inside_each_sample():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    allowed = ~block_causal_mask(positions)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)


@pytest.fixture(scope="module")
def model_parallel():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with one_process_group(), cpu_backend.active("cpu"):  # a gloo group: the model is on CPU on every machine
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(7)
        yield
        parallel_state.destroy_model_parallel()


def packed_and_alone_losses(provider):
    """Per-sample losses of 8 samples (9-41 tokens) run alone and packed into 64-token sequences."""
    provider.finalize()
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = provider.provide(pre_process=True, post_process=True).to(device).eval()
    gen = torch.Generator().manual_seed(1)
    samples = []
    for n in (9, 30, 17, 5, 41, 12, 23, 3):
        ids = torch.randint(0, 128, (n,), generator=gen).numpy()
        flags = np.ones(n, dtype=np.uint8)
        flags[: n // 3] = 0  # a prompt outside the loss
        samples.append((ids, flags))

    def per_sample(losses, mask):
        return float((losses * mask).sum() / mask.sum())

    with torch.no_grad():
        alone = []
        for ids, flags in samples:
            tokens = torch.tensor(ids[:-1]).unsqueeze(0).to(device)
            labels = torch.tensor(ids[1:]).unsqueeze(0).to(device)
            losses = model(tokens, torch.arange(len(ids) - 1, device=device).unsqueeze(0), None, labels=labels).cpu()
            alone.append(per_sample(losses[0], torch.tensor(flags[1:], dtype=torch.float32)))

        packed = PackedSamples.from_samples(samples, 64, seed=0)
        ds = PackedSFTDataset(packed, 64, len(packed), seed=0, pad_id=0)
        found = {}
        for b in range(len(packed)):
            item = ds[b]
            batch = ds.collate_fn([item])
            inputs = [batch[k].to(device) for k in ("tokens", "position_ids", "attention_mask", "labels")]
            losses = model(*inputs[:3], labels=inputs[3])[0].cpu()
            for i, (a, z) in zip(packed.bin(b), zip(item["bounds"], item["bounds"][1:])):
                found[int(i)] = per_sample(losses[a:z], batch["loss_mask"][0, a:z])
    assert len(packed) < len(samples)
    return [found[i] for i in range(len(samples))], alone


@pytest.mark.parametrize("positions", ["rope", "learned_absolute"])
def test_packed_and_unpacked_give_the_same_per_sample_loss(model_parallel, positions):
    provider = tiny_model(seq_length=64, vocab_size=128, position_embedding_type=positions, **cpu_backend.CPU_MODEL_SETTINGS)
    packed, alone = packed_and_alone_losses(provider)
    for i, (found, expected) in enumerate(zip(packed, alone)):
        assert abs(found - expected) < 1e-5, (i, found, expected)


@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_packing_keeps_samples_apart_with_a_sliding_window(model_parallel, backend):
    """A Mistral-like model (grouped-query attention, an 8-token window on alternate layers) on
    local layers, SDPA (auto) and megatron-core's unfused attention: each sample's loss is the
    same packed as alone (megatron-core's own window mask would replace the packing mask)."""
    from megatron.core.transformer.enums import AttnBackend

    from factories import tiny_llama_model

    provider = tiny_llama_model(
        seq_length=64, vocab_size=128, num_layers=3, window_size=(7, 0), window_attn_skip_freq=3,
        attention_backend=AttnBackend[backend], **cpu_backend.CPU_MODEL_SETTINGS,
    )  # fmt: skip
    packed, alone = packed_and_alone_losses(provider)
    for i, (found, expected) in enumerate(zip(packed, alone)):
        assert abs(found - expected) < 1e-5, (i, found, expected)


def test_the_packed_cache_is_reused_for_the_same_data_only(tmp_path):
    (tmp_path / "training.jsonl").write_text("{}\n")
    source = SimpleNamespace(files=(str(tmp_path / "training.jsonl"),), dataset_dir=None)
    specs = SimpleNamespace(packed_sequence_size=None, packed_train_data_path=None, packed_val_data_path=None, on_the_fly=False)
    data = SimpleNamespace(seq_length=16, seed=3)
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 50, n), np.ones(n, dtype=np.uint8)) for n in (5, 9, 12, 4, 7)]
    calls = []

    def tokenized():
        calls.append(1)
        return samples

    first = packed_dataset(tokenized, "data-v1", source, "train", specs, data, 10, 0, "mask")
    again = packed_dataset(tokenized, "data-v1", source, "train", specs, data, 10, 0, "mask")
    assert len(calls) == 1 and len(list((tmp_path / "packed").iterdir())) == 1
    assert [again[i]["tokens"].tolist() for i in range(3)] == [first[i]["tokens"].tolist() for i in range(3)]
    packed_dataset(tokenized, "data-v2", source, "train", specs, data, 10, 0, "mask")  # other data or tokenizer
    specs.on_the_fly = True
    packed_dataset(tokenized, "data-v1", source, "train", specs, data, 10, 0, "mask")
    assert len(calls) == 3 and len(list((tmp_path / "packed").iterdir())) == 2


def test_packing_settings_are_checked_and_round_trip(tmp_path):
    from factories import tiny_config

    from megatron_bridge.config.errors import ConfigValidationError
    from megatron_bridge.training.config import ConfigContainer, FinetuningDatasetConfig, PackedSequenceSpecs, runtime_config_update
    from megatron_bridge.config.overrides import process_config_with_overrides

    def cfg(**model):
        return tiny_config(
            model=tiny_model(**model),
            dataset=FinetuningDatasetConfig(dataset_root=str(tmp_path), seq_length=32, num_workers=0, packed_sequence_specs=PackedSequenceSpecs(packed_sequence_size=64)),
        )

    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg(context_parallel_size=2, seq_length=32, calculate_per_token_loss=True), world_size=2)
    assert err.value.errors == [
        "dataset.packed_sequence_specs.packed_sequence_size: 64 exceeds model.seq_length=32 (pack to at most the model's sequence length)",
        "dataset.packed_sequence_specs: packed sequences are not split over context-parallel ranks (context_parallel_size=2) "
        "(use context_parallel_size=1 with packing, or turn packing off)",
    ]
    good = cfg(seq_length=64)
    runtime_config_update(good)
    again = ConfigContainer.from_yaml(_write(tmp_path / "c.yaml", good.to_yaml()))
    assert again.dataset.packed_sequence_specs == good.dataset.packed_sequence_specs
    plain = tiny_config(model=tiny_model(seq_length=64), dataset=FinetuningDatasetConfig(dataset_root=str(tmp_path), seq_length=64, num_workers=0))
    process_config_with_overrides(plain, cli_overrides=["dataset.packed_sequence_specs={packed_sequence_size:64,on_the_fly:true}", "dataset.column_mapping={input:q,output:a}"])
    assert plain.dataset.packed_sequence_specs == PackedSequenceSpecs(packed_sequence_size=64, on_the_fly=True)
    assert plain.dataset.column_mapping == {"input": "q", "output": "a"}


def _write(path, text):
    path.write_text(text)
    return str(path)
