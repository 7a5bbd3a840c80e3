"""The dataset section of a run: megatron-core GPT datasets, fine-tuning JSONL, and user providers.

Its public import path is `megatron_bridge.training.config` (and `.data` there): configs are
written and read with those names."""

from __future__ import annotations

import abc
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Tuple, Union

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MCoreGPTDatasetConfig

from megatron_bridge.config.base import ConfigBase, config_dataclass, finalize_into
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import COUNT, PROBABILITY, SEED, Unsupported, field, parse
from megatron_bridge.config.targets import register_target
from megatron_bridge.data.phase_schedule import check_phases
from megatron_bridge.data.sft_records import check_sft_options


@config_dataclass(kw_only=True)
class DataloaderConfig(ConfigBase):
    """Base configuration for data loading."""

    dataloader_type: Optional[Literal["single", "cyclic", "batch", "external"]] = None
    """'single': one pass in order; 'cyclic': repeated passes, reshuffled each epoch; 'batch':
    global-batch sampling that pads each global batch to a common length (fine-tuning);
    'external': the dataset is already an iterator and is used as is."""

    num_workers: int = field(2, range=COUNT)
    """Dataloader number of workers."""

    data_sharding: bool = True
    """Shard the data over data-parallel ranks when building cyclic samplers."""

    pin_memory: bool = True
    """Whether to pin memory during data loading for faster GPU training."""

    drop_last: bool = True
    """Whether to drop the last incomplete batch."""

    persistent_workers: bool = True
    """Keep dataloader workers alive across epochs. Turned off when num_workers is 0."""

    worker_start_method: Optional[Literal["fork", "spawn", "forkserver"]] = None
    """How dataloader workers start; None: torch's default (fork on Linux). 'spawn' or
    'forkserver' when the training process holds libraries that are unsafe to fork."""

    trust_remote_code: Optional[bool] = None
    """Whether remote code execution should be trusted for a given HF path."""

    def _finalize(self, problems: Problems) -> None:
        if self.num_workers == 0 and self.persistent_workers:
            self._derive("persistent_workers", False)
        problems.check(
            self.dataloader_type != "external" or isinstance(self, DatasetProvider),
            "dataloader_type",
            f"'external' takes the dataset as an iterator of micro batches (what a DatasetProvider's build_datasets "
            f"may return), but {type(self).__name__} builds datasets of single samples",
            "use 'single', 'cyclic' or 'batch', or leave dataset.dataloader_type unset",
        )


@dataclass
class DatasetBuildContext:
    """What a dataset builder gets from the framework."""

    train_samples: int = None
    """Number of samples for the training dataset."""

    valid_samples: int = None
    """Number of samples for the validation dataset."""

    test_samples: int = None
    """Number of samples for the test dataset."""

    tokenizer: Optional[Any] = None
    """The tokenizer built from `cfg.tokenizer`."""

    pg_collection: Optional[Any] = None
    """megatron-core ProcessGroupCollection of the run."""


@config_dataclass(kw_only=True)
class DatasetProvider(DataloaderConfig, abc.ABC):
    """Base class for user datasets: subclass it as a dataclass, implement `build_datasets`, and
    put an instance in `cfg.dataset`. It inherits every dataloader setting.

    Example::

        @dataclass
        class MyData(DatasetProvider):
            path: str = "data.txt"
            seq_length: int = 128

            def build_datasets(self, context):
                return MyDataset(self.path, context.train_samples), None, None
    """

    @abc.abstractmethod
    def build_datasets(self, context: DatasetBuildContext) -> Tuple[Optional[Any], Optional[Any], Optional[Any]]:
        """Return (train, valid, test) datasets; any may be None. Each dataset yields dicts of
        tensors the forward step understands (the standard GPT step wants tokens, labels,
        loss_mask, position_ids and optionally attention_mask)."""
        raise NotImplementedError


def parse_data_path(data_path: Union[str, list[str]]) -> Tuple[list[str], Optional[list[float]]]:
    """Turn Megatron-LM `--data-path` values into a blend: prefixes with optional weights.

    Accepts "a b c", ["a", "b"], or weights interleaved before each prefix: "0.3 a 0.7 b".
    """
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise ValueError("data_path is empty")

    def as_weight(text: str) -> Optional[float]:
        return float(text) if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text) else None

    weights = [as_weight(x) for x in items[0::2]]
    if len(items) % 2 == 0 and all(w is not None for w in weights):
        return items[1::2], weights  # check_blend checks the weights
    if any(as_weight(x) is not None for x in items):
        raise ValueError(f"cannot tell weights from paths in {items}; give a weight before every path or none")
    return items, None


def check_blend(blend: Tuple[list[str], Optional[list[float]]], path: str, problems: Problems) -> None:
    """One weight per prefix, each a finite number > 0: megatron-core's blended dataset draws from
    every prefix and fails on a weight of 0 (its assertion, after the model is built)."""
    prefixes, weights = blend
    if weights is None:
        return
    if not problems.check(len(prefixes) == len(weights), path, f"{len(prefixes)} prefixes but {len(weights)} weights", "give one weight per prefix"):
        return
    bad = [(prefix, w) for prefix, w in zip(prefixes, weights) if not (math.isfinite(w) and w > 0)]
    problems.check(
        not bad,
        path,
        "blend weights must be finite numbers > 0, got " + ", ".join(f"{w} for {prefix}" for prefix, w in bad),
        "give each prefix a weight > 0, or leave it out (dataset.blend_phases can bring a prefix in at a later iteration)",
    )


@config_dataclass(kw_only=True)
class GPTDatasetConfig(MCoreGPTDatasetConfig, DataloaderConfig):
    """Megatron Core GPTDatasetConfig with deferred post-init.

    Construction stores values only; `finalize()` turns `data_path` into `blend`, fills in the
    split and mock flags, and checks everything. `seq_length` is accepted as an alias of
    `sequence_length`.
    """

    _field_aliases = {"seq_length": "sequence_length"}
    _positional_fields = ("seq_length", "skip_getting_attention_mask_from_dataset", "data_path")

    random_seed: int = 1234
    """The seed for all RNG during dataset creation (sample order, mock data)."""

    sequence_length: Optional[int] = None
    """Tokens per sample; must equal model.seq_length."""

    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""

    reset_attention_mask: bool = False
    """Block attention across end-of-document tokens."""

    eod_mask_loss: bool = False
    """Exclude end-of-document tokens from the loss."""

    data_path: Optional[Union[str, list[str]]] = None
    """CLI-friendly alternative to `blend`: one path prefix, space-separated prefixes, or a list,
    optionally with a weight before each prefix (Megatron-LM `--data-path`). Converted to `blend`
    by finalize()."""

    skip_getting_attention_mask_from_dataset: bool = True
    """Pass no attention mask from the dataset; the attention backend builds the causal mask."""

    split: Optional[str] = None
    """Weights of the train, valid and test splits of the data in `blend`, e.g. '969,30,1'
    (normalized; missing trailing weights are 0). With a blend but no split: '99,1,0' (NVIDIA
    Megatron Bridge requires one). Not used with `blend_per_split`; mock data splits evenly."""

    blend_phases: Optional[list[dict[str, Any]]] = None
    """Phases of the blend's training mixture: a list of {weights: [one per prefix],
    start_iteration: N (or start_fraction: 0.9), name: ...}; the weights change at each start
    (exactly, also across resume). Before the first phase the blend's own weights apply."""

    def __post_init__(self) -> None:
        """Skip megatron-core's post-init; `finalize()` runs it."""

    @property
    def seq_length(self) -> Optional[int]:
        """Alias for `sequence_length`."""
        return self.sequence_length

    def _finalize(self, problems: Problems) -> None:
        p = problems
        super()._finalize(p)  # the dataloader settings
        p.check(self.sequence_length is not None, "sequence_length", "is not set", "set dataset.seq_length")
        if self.data_path is not None:
            if self.blend is not None or self.blend_per_split is not None:
                p.add("data_path", "data_path and blend/blend_per_split are both set", "give the data one way")
            else:
                try:
                    self._derive("blend", parse_data_path(self.data_path))
                except ValueError as exc:
                    p.add("data_path", str(exc), "e.g. dataset.data_path='0.7 /data/a 0.3 /data/b'")
        if self.blend is not None and self.split is None:
            self._derive("split", "99,1,0")
        if self.split is not None:
            p.check(
                bool(re.fullmatch(r"\s*\d*\.?\d+(\s*[,/]\s*\d*\.?\d+){0,2}\s*", self.split))
                and sum(map(float, re.findall(r"\d*\.?\d+", self.split))) > 0,
                "split",
                f"{self.split!r} is not a train,valid,test weighting",
                "use e.g. '969,30,1'",
            )
        if self.blend is not None:
            check_blend(self.blend, "data_path" if self.data_path is not None else "blend", p)
        per_split = self.blend_per_split
        if per_split is not None and any(per_split) and p.check(
            len(per_split) == 3,
            "blend_per_split",
            f"has {len(per_split)} entries",
            "give three blends, [train, valid, test] (null for a split without data)",
        ):
            for name, blend in zip(("train", "valid", "test"), per_split):
                if blend is not None:
                    check_blend(blend, f"blend_per_split.{name}", p)
        if self.blend_phases is not None:
            blend = self.blend
            if p.check(
                blend is not None,
                "blend_phases",
                "phases change the weights of a blend, and no data_path/blend is set",
                "set dataset.data_path with several prefixes",
            ):
                check_phases(self.blend_phases, len(blend[0]), p)
        if not p:
            self._run_parent_post_init(BlendedMegatronDatasetConfig, p)


FIM = Unsupported("megatron-core 0.16.1 has no fill-in-the-middle dataset; use GPTDatasetConfig")
"""Why the fill-in-the-middle dataset config and its fields are not supported."""

@config_dataclass(kw_only=True)
class GPTFIMDatasetConfig(GPTDatasetConfig):
    """Configuration object for GPT fill-in-the-middle (FIM) datasets."""

    unsupported_reason: ClassVar[Unsupported] = FIM
    _positional_fields = (
        "fim_rate", "fim_spm_rate", "fim_extra_tokens", "fim_split_sample", "fim_fragment_rate", "fim_no_prefix",
    )  # fmt: skip

    fim_rate: Optional[float] = field(None, range=PROBABILITY, status=FIM)
    """Probability to convert a training sample into a FIM format."""

    fim_spm_rate: Optional[float] = field(None, range=PROBABILITY, status=FIM)
    """Probability that a FIM sample uses the SPM format over the PSM format."""

    fim_extra_tokens: Optional[dict] = field(None, status=FIM)
    """The prefix, middle, suffix, PAD and EOD tokens, as a dict."""

    fim_split_sample: Optional[str] = field(None, status=FIM)
    """String around which to split the sample for FIM."""

    fim_fragment_rate: Optional[float] = field(None, range=PROBABILITY, status=FIM)
    """Rate of FIM on each fragment when split_sample is not None."""

    fim_no_prefix: Optional[str] = field(None, status=FIM)
    """Do not apply FIM to fragments that start with this prefix."""

    def _finalize(self, problems: Problems) -> None:
        super()._finalize(problems)  # the rates are in [0, 1] by their declared ranges
        if self.fim_rate:
            problems.check(
                bool(self.fim_extra_tokens),
                "fim_extra_tokens",
                "FIM needs its prefix/middle/suffix/pad/eod tokens",
                "set dataset.fim_extra_tokens={prefix: ..., middle: ..., suffix: ..., pad: ..., eod: ...}",
            )


@config_dataclass(kw_only=True)
class MockGPTDatasetConfig(GPTDatasetConfig):
    """GPT dataset of random tokens (no files): for smoke tests, benchmarks and CPU runs."""

    _positional_fields = ("seq_length",)

    blend: None = field(init=False, repr=False, default=None)
    """Always None: mock data has no files."""

    blend_per_split: None = field(init=False, repr=False, default=None)
    """Always None: mock data has no files."""

    def _finalize(self, problems: Problems) -> None:
        problems.check(
            self.data_path is None,
            "data_path",
            f"mock data takes no files, got data_path={self.data_path!r}",
            "remove dataset.data_path or use GPTDatasetConfig",
        )
        if self.data_path is None:
            super()._finalize(problems)


@config_dataclass(kw_only=True)
class PackedSequenceSpecs(ConfigBase):
    """Sequence packing for fine-tuning: samples share sequences of `packed_sequence_size`
    tokens; attention stays within each sample and position ids restart per sample."""

    packed_sequence_size: Optional[int] = field(None, range=parse("[2, 2**31)", below="must be > 1"))
    """Tokens per packed sequence; None: dataset.seq_length. At least dataset.seq_length and at
    most model.seq_length."""

    packed_train_data_path: Optional[str] = None
    """File (.npz) caching the packed training split; None: packed/ beside the data."""

    packed_val_data_path: Optional[str] = None
    """File (.npz) caching the packed validation split; None: packed/ beside the data."""

    on_the_fly: bool = False
    """Pack in memory at every start instead of caching the packed data on disk."""


@config_dataclass(kw_only=True)
class FinetuningDatasetConfig(DataloaderConfig):
    """Configuration specific to finetuning datasets, inheriting from DataloaderConfig.

    `dataset_root` holds training.jsonl, validation.jsonl and test.jsonl; each line is a JSON object
    with an "input" (prompt) and an "output" (answer). The loss covers answer tokens only.
    """

    dataloader_type: Optional[Literal["single", "cyclic", "batch", "external"]] = "batch"
    """Dataloader type for fine-tuning. Defaults to 'batch', which pads each global batch to a
    common length."""

    dataset_root: Optional[Union[str, Path]] = None
    """The data: a directory with training.jsonl / validation.jsonl / test.jsonl, a directory of
    json/jsonl/parquet/arrow files (split by file name), a `datasets` save_to_disk directory, or
    one data file. Local only."""

    splits: Optional[dict[str, str]] = None
    """Which split of the data each run split reads, e.g. {train: 'train[:95%]', valid:
    'train[95%:]'}; defaults: train 'train', valid 'validation', test 'test'."""

    column_mapping: Optional[dict[str, str]] = None
    """Columns holding `input` / `output` (prompt/answer rows) or `messages` (chat rows), e.g.
    {input: question, output: answer}; default: those names."""

    seq_length: Optional[int] = field(None, range=parse("[2, 2**31)", below="must be > 1"))
    """Maximum tokens per sample (prompt + answer); longer samples are truncated."""

    seed: int = field(1234, range=SEED)
    """Seed for shuffling."""

    memmap_workers: int = field(1, range=COUNT)
    """Processes that tokenize the JSONL files (used for files of 1000 lines or more)."""

    max_train_samples: Optional[int] = field(None, range=parse("[1, 2**63)", below="must be positive"))
    """Use at most this many training examples."""

    packed_sequence_specs: Optional[PackedSequenceSpecs] = None
    """Pack samples into full sequences (see PackedSequenceSpecs); None: one sample per sequence."""

    dataset_kwargs: Optional[dict[str, Any]] = None
    """Extra options: `prompt_key` / `answer_key` (older spelling of column_mapping input/output)."""

    do_validation: bool = True
    """Build the validation split."""

    do_test: bool = True
    """Build the test split."""

    def _finalize(self, problems: Problems) -> None:
        p = problems
        super()._finalize(p)  # the dataloader settings
        p.check(self.dataset_root is not None, "dataset_root", "is not set", "set dataset.dataset_root to a directory")
        p.check(self.seq_length is not None, "seq_length", "is not set", "set dataset.seq_length")
        if self.packed_sequence_specs is not None:
            finalize_into(self.packed_sequence_specs, p.at("packed_sequence_specs"))

        check_sft_options(self, p)


for _cls in (DataloaderConfig, DatasetProvider, GPTDatasetConfig, GPTFIMDatasetConfig, MockGPTDatasetConfig,
             PackedSequenceSpecs, FinetuningDatasetConfig):  # fmt: skip
    register_target(_cls, f"megatron_bridge.training.config.data.{_cls.__name__}", canonical=True)
