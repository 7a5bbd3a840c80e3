"""Fine-tuning datasets: prompt/answer or chat rows, tokenized, with a loss mask on the answer
or the assistant turns; packed into full sequences when `dataset.packed_sequence_specs` is set.

The data (`dataset.dataset_root`) is a directory with `training.jsonl` / `validation.jsonl` /
`test.jsonl`, a directory of json/jsonl/parquet/arrow files, a `datasets` directory
(save_to_disk), or one data file; see `sft_records` for the formats. A prompt/answer sample is
`[bos] prompt answer eod`; every sample is truncated to `seq_length + 1` tokens.
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.data.sft_records import CHAT, SPLITS, RecordFormat, column_mapping, detect_format, record_problem, split_sources
from megatron_bridge.models.attention import core_attention_choice
from megatron_bridge.runtime.child_processes import worker_pool
from megatron_bridge.data.chat import ChatRenderer
from megatron_bridge.data.hf_local import LocalSplit
from megatron_bridge.data.packing import packed_dataset
from megatron_bridge.data.samples import EpochOrder, Sample

if TYPE_CHECKING:
    from megatron_bridge.data.builders import SampleCounts
    from megatron_bridge.training.config import FinetuningDatasetConfig

logger = logging.getLogger(__name__)


def read_examples(path: str, prompt_key: str, answer_key: str, limit: Optional[int] = None) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of a JSONL file; a line without both keys is an error naming it."""
    fmt = RecordFormat("prompt/answer", prompt=prompt_key, answer=answer_key)
    return [(str(r[prompt_key]), str(r[answer_key])) for r in _valid_records(LocalSplit("train", files=(path,)), fmt, None, limit)]


def _valid_records(source: Any, fmt: RecordFormat, null_vocab: Optional[int], limit: Optional[int]) -> list[dict]:
    records = []
    for location, record in source.records(fmt.columns()):
        problem = record_problem(record, fmt, location, null_vocab)
        if problem:
            raise ValueError(problem[1])
        records.append(record)
        if limit is not None and len(records) >= limit:
            break
    return records


# ---------------------------------------------------------------------- tokenization
class SampleEncoder:
    """Rows of one format to samples."""

    def __init__(self, tokenizer: Any, fmt: RecordFormat, seq_length: int):
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.limit = seq_length + 1
        self.renderer = None
        if fmt.kind == CHAT:
            self.renderer = ChatRenderer(tokenizer)

    def __reduce__(self):
        # Sent to worker processes: the compiled chat template does not pickle, so it is rebuilt there.
        return (SampleEncoder, (self.tokenizer, self.fmt, self.limit - 1))

    def encode(self, record: dict) -> Sample:
        if self.renderer is not None:
            ids, flags = self.renderer.encode(record[self.fmt.messages])
        else:
            prompt = self.tokenizer.tokenize(str(record[self.fmt.prompt]))
            answer = self.tokenizer.tokenize(str(record[self.fmt.answer]))
            return prompt_answer_sample(prompt, answer, self.tokenizer, self.limit)
        return ids[: self.limit], flags[: self.limit]


def prompt_answer_sample(prompt: list[int], answer: list[int], tokenizer: Any, limit: int) -> Sample:
    head = ([tokenizer.bos] if getattr(tokenizer, "bos", None) is not None else []) + list(prompt)
    ids = np.asarray(head + list(answer) + [tokenizer.eod], dtype=np.int64)[:limit]
    flags = np.zeros(len(ids), dtype=np.uint8)
    flags[len(head) :] = 1
    return ids, flags


_WORKER_ENCODER: Optional[SampleEncoder] = None


def _init_worker(encoder: SampleEncoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def _encode_in_worker(record: dict) -> Sample:
    return _WORKER_ENCODER.encode(record)


def encode_records(records: list[dict], encoder: SampleEncoder, workers: int) -> list[Sample]:
    """Samples of `records`, in order; in `workers` processes for 1000 rows or more."""
    if workers <= 1 or len(records) < 1000:
        return [encoder.encode(r) for r in records]
    with worker_pool(workers, _init_worker, (encoder,)) as pool:
        return list(pool.map(_encode_in_worker, records, chunksize=256))


# ---------------------------------------------------------------------- datasets
class SFTDataset(torch.utils.data.Dataset):
    """Samples with a loss mask on the flagged tokens; `num_samples` larger than the data
    repeats it, reshuffled each pass (seeded)."""

    def __init__(self, samples: list[Sample], seq_length: int, num_samples: int, seed: int, pad_id: int, pad_multiple: int = 8, pad_to: Optional[int] = None):
        if not samples:
            raise ValueError("the fine-tuning data has no examples")
        self.samples = samples
        self.seq_length = seq_length
        self.order = EpochOrder(len(samples), num_samples, seed)
        self.pad_id = pad_id
        self.pad_multiple = pad_multiple
        self.pad_to = pad_to

    def __len__(self) -> int:
        return self.order.num_samples

    def __getitem__(self, idx: int) -> dict[str, list[int]]:
        ids, flags = self.samples[self.order(idx)]
        # label j is ids[j + 1]: it counts when token j + 1 is flagged
        return {"tokens": ids[:-1].tolist(), "labels": ids[1:].tolist(), "loss_mask": flags[1:].astype(np.int64).tolist()}

    def collate_fn(self, items: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        """Pad every sample of the batch to one length (the longest, rounded up to
        `pad_multiple`, or `pad_to` when the pipeline needs a fixed shape)."""
        longest = max(len(it["tokens"]) for it in items)
        length = self.pad_to or min(self.seq_length, math.ceil(longest / self.pad_multiple) * self.pad_multiple)
        batch = {key: torch.full((len(items), length), fill, dtype=torch.long) for key, fill in (("tokens", self.pad_id), ("labels", self.pad_id), ("loss_mask", 0))}
        for row, it in enumerate(items):
            n = len(it["tokens"])
            batch["tokens"][row, :n] = torch.tensor(it["tokens"])
            batch["labels"][row, :n] = torch.tensor(it["labels"])
            batch["loss_mask"][row, :n] = torch.tensor(it["loss_mask"])
        batch["loss_mask"] = batch["loss_mask"].float()
        batch["position_ids"] = torch.arange(length).unsqueeze(0).expand(len(items), length).contiguous()
        return batch


def pad_id_of(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad", -1)
    return pad if pad is not None and pad >= 0 else 0


class PromptAnswerDataset(SFTDataset):
    """Prompt/answer token-id pairs with a loss mask on the answer (and the closing end-of-document)."""

    def __init__(self, pairs: list[tuple[list[int], list[int]]], tokenizer: Any, seq_length: int, num_samples: int, seed: int, pad_multiple: int = 8, pad_to: Optional[int] = None):
        samples = [prompt_answer_sample(p, a, tokenizer, seq_length + 1) for p, a in pairs]
        super().__init__(samples, seq_length, num_samples, seed, pad_id_of(tokenizer), pad_multiple, pad_to)


# ---------------------------------------------------------------------- building
def check_loss_tokens(samples: list[Sample], split: str, seq_length: int) -> None:
    """Samples are truncated to `seq_length`: one whose prompt fills it keeps no answer token and
    trains nothing (a step of only such samples has no loss at all). Some such samples are
    logged; a split of nothing but such samples is refused."""
    # the first token is never a label: it is the input of the first prediction
    empty = sum(1 for _, flags in samples if not flags[1:].any())
    if not empty:
        return
    what = f"{empty} of the {len(samples)} {split} samples keep no answer token within dataset.seq_length={seq_length}"
    fix = "raise dataset.seq_length (up to model.seq_length) or shorten the prompts"
    if empty == len(samples):
        raise ConfigValidationError(ConfigProblem("dataset.seq_length", f"{what}: their prompts fill it", fix))
    logger.warning("%s (their prompts fill it): they add nothing to the loss; %s", what, fix)


def build_finetuning_datasets(data: "FinetuningDatasetConfig", tokenizer: Any, counts: "SampleCounts", model: Any = None):
    """(train, valid, test) datasets from `data.dataset_root`."""
    pad_multiple, pad_to = 8, None
    if model is not None:
        pad_multiple = math.lcm(8, 2 * model.context_parallel_size, model.tensor_model_parallel_size if model.sequence_parallel else 1)
        if model.pipeline_model_parallel_size > 1:
            pad_to = data.seq_length  # pipeline stages exchange fixed-shape activations
    wanted = {"train": counts.train, "valid": counts.valid if data.do_validation else 0, "test": counts.test if data.do_test else 0}
    sources = split_sources(data)
    mapping = column_mapping(data)
    null_vocab = tokenizer.vocab_size if type(tokenizer).__name__ == "NullTokenizer" else None
    datasets = []
    for split in SPLITS:
        source = sources[split]
        if not wanted[split] or source is None:
            datasets.append(None)
            continue
        fmt = detect_format(source.columns(), mapping, source.describe())
        limit = data.max_train_samples if split == "train" else None

        def tokenized(source=source, fmt=fmt, limit=limit, split=split) -> list[Sample]:
            records = _valid_records(source, fmt, null_vocab, limit)
            samples = encode_records(records, SampleEncoder(tokenizer, fmt, data.seq_length), data.memmap_workers)
            check_loss_tokens(samples, split, data.seq_length)
            return samples

        specs = data.packed_sequence_specs
        if specs is not None:
            key = json.dumps([source.identity(), str(fmt), dict(tokenizer.unique_identifiers), data.seq_length, limit], sort_keys=True, default=str)
            attention = "cu_seqlens" if model is not None and core_attention_choice(model).kind == "te" else "mask"
            datasets.append(packed_dataset(tokenized, key, source, split, specs, data, wanted[split], pad_id_of(tokenizer), attention))
        else:
            datasets.append(SFTDataset(tokenized(), data.seq_length, wanted[split], data.seed, pad_id_of(tokenizer), pad_multiple, pad_to))
    return tuple(datasets)
