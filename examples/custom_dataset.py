"""Train the tiny GPT on your own data with a `DatasetProvider`: here, the bytes of a text file
(a byte is a token: vocabulary 256, no tokenizer to train).

    python examples/custom_dataset.py --text README.md --dir runs/example_data --train-iters 20
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from megatron_bridge.training.config import DatasetProvider
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain
from megatron_bridge.training.tokenizers.config import TokenizerConfig
from recipes import tiny_gpt_pretrain_config


class ByteWindows(torch.utils.data.Dataset):
    """`count` windows of `seq_length + 1` bytes from a file, each a next-byte prediction sample."""

    def __init__(self, path: str, seq_length: int, count: int, offset: int = 0):
        with open(path, "rb") as f:
            self.data = torch.tensor(list(f.read()), dtype=torch.long)
        if len(self.data) <= seq_length + 1:
            raise ValueError(f"{path} has {len(self.data)} bytes; need more than {seq_length + 1}")
        self.seq_length, self.count, self.offset = seq_length, count, offset

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        starts = len(self.data) - self.seq_length - 1
        start = ((i + self.offset) * 997) % starts  # spread over the file, the same on every run
        window = self.data[start : start + self.seq_length + 1]
        return {
            "tokens": window[:-1],
            "labels": window[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float),
            "position_ids": torch.arange(self.seq_length),
        }


@dataclass(kw_only=True)
class ByteFileData(DatasetProvider):
    """The bytes of one text file; validation reads other windows of it."""

    path: str
    seq_length: int = 64

    def build_datasets(self, context):
        # The framework says how many samples each split needs (train_iters x global batch, ...).
        train = ByteWindows(self.path, self.seq_length, context.train_samples)
        valid = ByteWindows(self.path, self.seq_length, context.valid_samples, offset=context.train_samples)
        return train, valid, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default="README.md", help="the text file to train on")
    parser.add_argument("--dir", default="runs", help="where checkpoints and logs go")
    parser.add_argument("--train-iters", type=int, default=100)
    args = parser.parse_args()

    cfg = tiny_gpt_pretrain_config(dir=args.dir, name="example_data", train_iters=args.train_iters)
    cfg.dataset = ByteFileData(path=args.text, seq_length=cfg.model.seq_length, num_workers=0)
    cfg.tokenizer = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=256)
    state = pretrain(cfg, forward_step)
    print(f"trained {state.train_state.step} iterations on the bytes of {args.text}")


if __name__ == "__main__":  # the checkpoint writer re-imports this file in its helper processes
    main()
