"""The dataset section of a run (public import path): its classes live in
`megatron_bridge.data.config`, below the packages that build datasets."""

from megatron_bridge.data.config import (  # noqa: F401
    DataloaderConfig,
    DatasetBuildContext,
    DatasetProvider,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    GPTFIMDatasetConfig,
    MockGPTDatasetConfig,
    PackedSequenceSpecs,
)
