"""Fine-tuning data: JSONL files of prompt/answer pairs; the loss covers the answer only.

`<dataset_root>/training.jsonl` (and `validation.jsonl`, `test.jsonl`) hold one JSON object per
line, e.g. `{"input": "What is 2+2?", "output": "4"}` (keys configurable through
`dataset_kwargs={"prompt_key": ..., "answer_key": ...}`). A sample is
`[bos] prompt answer eod`, truncated to `seq_length + 1` tokens.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from megatron_bridge.data.builders import SampleCounts
    from megatron_bridge.training.config import FinetuningDatasetConfig

SPLIT_FILES = {"train": "training.jsonl", "valid": "validation.jsonl", "test": "test.jsonl"}


def read_examples(path: str, prompt_key: str, answer_key: str, limit: Optional[int] = None) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of a JSONL file; a line without both keys is an error naming it."""
    examples = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                examples.append((str(record[prompt_key]), str(record[answer_key])))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{number}: expected a JSON object with {prompt_key!r} and {answer_key!r} ({exc})"
                ) from None
            if limit is not None and len(examples) >= limit:
                break
    return examples


_WORKER_TOKENIZER: Any = None


def _init_worker(tokenizer: Any) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _tokenize_pair(pair: tuple[str, str]) -> tuple[list[int], list[int]]:
    return _WORKER_TOKENIZER.tokenize(pair[0]), _WORKER_TOKENIZER.tokenize(pair[1])


def tokenize_examples(examples: list[tuple[str, str]], tokenizer: Any, workers: int) -> list[tuple[list[int], list[int]]]:
    """Token ids of each (prompt, answer); in `workers` processes for large files."""
    if workers <= 1 or len(examples) < 1000:
        return [(tokenizer.tokenize(p), tokenizer.tokenize(a)) for p, a in examples]
    with multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        return pool.map(_tokenize_pair, examples, chunksize=256)


class PromptAnswerDataset(torch.utils.data.Dataset):
    """Prompt/answer samples with a loss mask on the answer (and the closing end-of-document).

    `num_samples` larger than the file repeats it, reshuffled each epoch (seeded).
    """

    def __init__(self, pairs: list[tuple[list[int], list[int]]], tokenizer: Any, seq_length: int, num_samples: int, seed: int, pad_multiple: int = 8, pad_to: Optional[int] = None):
        if not pairs:
            raise ValueError("the fine-tuning file has no examples")
        self.pairs = pairs
        self.seq_length = seq_length
        self.num_samples = max(num_samples, len(pairs))
        self.seed = seed
        self.eod = tokenizer.eod
        self.bos = getattr(tokenizer, "bos", None)
        self.pad_id = tokenizer.pad if getattr(tokenizer, "pad", -1) is not None and tokenizer.pad >= 0 else 0
        self.pad_multiple = pad_multiple
        self.pad_to = pad_to

    def __len__(self) -> int:
        return self.num_samples

    def _example_index(self, idx: int) -> int:
        epoch, position = divmod(idx, len(self.pairs))
        if epoch == 0:
            return position
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return int(torch.randperm(len(self.pairs), generator=g)[position])

    def __getitem__(self, idx: int) -> dict[str, list[int]]:
        prompt, answer = self.pairs[self._example_index(idx)]
        head = ([self.bos] if self.bos is not None else []) + prompt
        ids = (head + answer + [self.eod])[: self.seq_length + 1]
        tokens, labels = ids[:-1], ids[1:]
        # label j is ids[j + 1]: it belongs to the answer from position len(head) on
        loss_mask = [1 if j + 1 >= len(head) else 0 for j in range(len(labels))]
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}

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


def build_finetuning_datasets(data: "FinetuningDatasetConfig", tokenizer: Any, counts: "SampleCounts", model: Any = None):
    """(train, valid, test) prompt/answer datasets from `data.dataset_root`."""
    kwargs = data.dataset_kwargs or {}
    prompt_key, answer_key = kwargs.get("prompt_key", "input"), kwargs.get("answer_key", "output")
    pad_multiple, pad_to = 8, None
    if model is not None:
        pad_multiple = math.lcm(8, 2 * model.context_parallel_size, model.tensor_model_parallel_size if model.sequence_parallel else 1)
        if model.pipeline_model_parallel_size > 1:
            pad_to = data.seq_length  # pipeline stages exchange fixed-shape activations
    wanted = {"train": counts.train, "valid": counts.valid if data.do_validation else 0, "test": counts.test if data.do_test else 0}
    datasets = []
    for split, file in SPLIT_FILES.items():
        path = os.path.join(os.fspath(data.dataset_root), file)
        if not wanted[split]:
            datasets.append(None)
            continue
        if not os.path.isfile(path):
            if split == "train":
                raise FileNotFoundError(f"dataset.dataset_root: no {file} in {data.dataset_root!r}")
            datasets.append(None)
            continue
        limit = data.max_train_samples if split == "train" else None
        pairs = tokenize_examples(read_examples(path, prompt_key, answer_key, limit), tokenizer, data.memmap_workers)
        datasets.append(PromptAnswerDataset(pairs, tokenizer, data.seq_length, wanted[split], data.seed, pad_multiple, pad_to))
    return tuple(datasets)
