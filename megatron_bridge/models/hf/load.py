"""Hugging Face weights into megatron-core model chunks: checked, then each rank reads its slices.

`check_hf_directory` validates config.json and the weight files without building anything;
`load_hf_weights` fills the parameters of this rank's model chunks (its pipeline stages, its
tensor-parallel part, its experts) by reading exactly those slices from the safetensors files.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Optional

from megatron_bridge.config.errors import ConfigValidationError, Problems
from megatron_bridge.models.hf import mapping
from megatron_bridge.models.hf.config import provider_from_hf_config, read_hf_config
from megatron_bridge.models.hf.reader import SafetensorsReader, check_index, check_weights, weight_map
from megatron_bridge.runtime.checkpointing.weights import is_adapter_key, unwrap

logger = logging.getLogger("megatron_bridge")


def expected_weights(hf: dict) -> tuple[mapping.Architecture, dict[str, tuple[int, ...]], tuple[str, ...]]:
    """(architecture, {tensor: shape} config.json implies, optional tensors) of an accepted config."""
    arch = mapping.architecture(hf)
    expected = mapping.expected_tensors(arch)
    optional = ("lm_head.weight",) if arch.tied else ()
    return arch, expected, optional


def ignored_tensors(hf: dict) -> re.Pattern:
    """The tensors of an accepted config's files that are not loaded: recomputed ones, and those
    its family leaves out on purpose (`HFFamily.skipped_tensors`)."""
    skipped = mapping.architecture(hf).family.skipped_tensors(hf)
    return re.compile(f"{mapping.IGNORED_TENSORS.pattern}|{skipped}") if skipped else mapping.IGNORED_TENSORS


def log_skipped(directory: str, hf: dict) -> None:
    """One log line naming the tensors of `directory` its family leaves out on purpose."""
    family = mapping.architecture(hf).family
    pattern = family.skipped_tensors(hf)
    if not pattern:
        return
    names = [name for name in weight_map(directory) if re.match(pattern, name)]
    if names:
        prefixes = ", ".join(sorted({re.match(pattern, name).group(0) + "*" for name in names}))
        logger.info("%s: %d tensors (%s) left out: %s", directory, len(names), prefixes, family.skipped_reason())


def check_hf_directory(directory: str, problems: Problems, weights: bool = True) -> Optional[Any]:
    """Check `directory` as a model to load: config.json converts to a provider, and its weights
    hold exactly the tensors config.json implies, with those shapes, in complete files
    (`weights=False`: only the index, so a directory with config.json and the index is enough).
    Returns the provider, or None with the problems added."""
    try:
        hf = read_hf_config(directory)
    except ConfigValidationError as exc:
        problems.absorb(exc)
        return None
    start = len(problems)
    provider = provider_from_hf_config(hf, problems, where=f"{directory}/config.json")
    if provider is None or len(problems) > start:
        return None
    arch, expected, optional = expected_weights(hf)
    check = check_weights if weights else check_index
    found = check(directory, expected, problems.at(""), optional, ignored_tensors(hf))
    if weights and found is not None and arch.tied and "lm_head.weight" in found:
        check_tied_output(directory, arch, problems)
    return provider if len(problems) == start else None


def check_tied_output(directory: str, arch: mapping.Architecture, problems: Problems, rows: int = 8192) -> None:
    """A config.json with `tie_word_embeddings` whose files also hold an `lm_head.weight` that
    differs from the embedding: transformers then leaves the two untied (the file's lm_head
    computes the logits), which a tied conversion would silently not reproduce. Compared
    `rows` rows at a time, so a large vocabulary is never read whole."""
    import torch

    embedding = mapping.rule_for(arch, "embedding.word_embeddings.weight").name
    reader = SafetensorsReader(directory)
    vocab = reader.info(embedding).shape[0]
    same = reader.info("lm_head.weight").shape == reader.info(embedding).shape
    for start in range(0, vocab, rows):
        if not same:
            break
        stop = min(start + rows, vocab)
        same = torch.equal(reader.read("lm_head.weight", 0, start, stop), reader.read(embedding, 0, start, stop))
    if not same:
        problems.add(
            "",
            f"{directory}/config.json: field tie_word_embeddings = true, but the weights also hold an lm_head.weight "
            f"that differs from {embedding} (transformers then unties them: that lm_head computes the logits)",
            "set \"tie_word_embeddings\": false in config.json to convert both, or remove lm_head.weight from the weights",
        )


def named_global_parameters(chunk: Any, hf: dict) -> list[tuple[str, Any, mapping.Rule, mapping.Partition]]:
    """(global name, parameter, rule, partition) for every parameter of one model chunk (the bare
    GPTModel inside DDP/Float16Module wrappers) of the model config.json `hf` describes. The
    partition follows from the shapes: the part this rank holds against the whole parameter.
    LoRA/DoRA adapter parameters are left out: the Hugging Face model has only the base weights.
    So are multi-token-prediction layers (`mtp.*`), which no mapped architecture has: an export
    leaves them out, a load leaves them at their initialization (both logged)."""
    from megatron.core import parallel_state as ps

    arch = mapping.architecture(hf)
    model = unwrap(chunk)
    expert_rank = ps.get_expert_model_parallel_rank() if arch.num_experts else 0
    rename = mapping.global_names(model, arch.num_experts, expert_rank)
    out = []
    buffers = [(local, b) for local, b in model.named_buffers() if mapping.entry_for(arch, rename(local)) is not None]
    mtp = [local for local, _ in model.named_parameters() if local.startswith("mtp.")]
    if mtp:
        logger.info("the %d multi-token-prediction parameters (mtp.*) have no Hugging Face counterpart in %s: "
                    "not exported, and left at their initialization on import", len(mtp), arch.model_type)  # fmt: skip
    for local, param in [*model.named_parameters(), *buffers]:  # buffers: those with weights (an expert bias)
        if is_adapter_key(local) or local.startswith("mtp."):
            continue
        name = rename(local)
        entry = mapping.entry_for(arch, name)
        if entry is None:
            raise ValueError(f"no Hugging Face tensor maps to the model's parameter {name!r}")
        rule = entry.rule
        if mapping.is_expert(name):
            rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        else:
            rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        padded = isinstance(rule, mapping.Vocab)
        part = mapping.partition(name, tuple(param.shape), entry.shape, rank, size, padded=padded)
        out.append((name, param, rule, part))
    return out


def load_hf_weights(chunks: list[Any], directory: str, map_files: bool = False) -> int:
    """Fill every parameter of `chunks` (this rank's model) from the Hugging Face directory;
    returns the bytes read. Each rank reads only the slices its parameters hold.

    `map_files` (for a model that is only written out again, as `import_hf` does): a parameter
    that is one whole-row slice of one file tensor, in its dtype, becomes a view of the mapped
    file instead of a copy; its bytes are read when they are used."""
    import torch

    started = time.perf_counter()
    hf = read_hf_config(directory)
    reader = SafetensorsReader(directory)
    log_skipped(directory, hf)
    with torch.no_grad():
        for chunk in chunks:
            for _, param, rule, part in named_global_parameters(chunk, hf):
                mapped = rule.mapped(reader, param.data, part) if map_files else None
                if mapped is not None:
                    param.data = mapped
                else:
                    rule.load(reader, param.data, part)
    logger.info(
        "loaded Hugging Face weights from %s: %.1f MB read by this rank in %.1f s",
        directory, reader.bytes_read / 1e6, time.perf_counter() - started,
    )  # fmt: skip
    return reader.bytes_read
