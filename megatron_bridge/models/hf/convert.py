"""Whole conversions: a Hugging Face directory to our checkpoint (`import_hf`), our checkpoint to
a Hugging Face directory (`export_checkpoint`), and a finished run's model to one (`save_run`).

Each works on every rank of the current launch (a plain process, or torchrun): the model is split
over the ranks as tensor/pipeline/expert parallelism, and each rank reads or writes its part.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional, Union

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError, Problems
from megatron_bridge.models import GPTModelProvider
from megatron_bridge.models.hf.config import (
    architecture_differences,
    hf_config_from_provider,
    provider_from_hf_config,
    read_hf_config,
)
from megatron_bridge.models.hf.files import (
    EXPORT_FIX, HF_ASSETS_DIR, check_replaceable, has_tokenizer, hf_origin, is_hf_directory, written_by_export,
)
from megatron_bridge.models.hf.load import check_hf_directory, load_hf_weights
from megatron_bridge.models.hf.registry import family_for_config
from megatron_bridge.models.hf.runtime import (
    build_chunks,
    load_checkpoint_weights,
    model_parallel,
    prepare,
    save_checkpoint_weights,
    stored_dtype,
    weights_only_config,
)
from megatron_bridge.models.hf.writer import DEFAULT_SHARD_BYTES, torch_dtype, write_hf_weights
from megatron_bridge.peft.apply import apply_peft, saved_with_peft
from megatron_bridge.peft.export import export_adapters
from megatron_bridge.peft.merge import base_of, read_adapter_checkpoint
from megatron_bridge.runtime.checkpointing.layout import TRACKER_FILE, iteration_dir, resolve
from megatron_bridge.runtime.checkpointing.run_config import read_run_config
from megatron_bridge.runtime.tokenizers.config import SENTENCEPIECE_TYPES, TokenizerConfig
from megatron_bridge.runtime.tokenizers.gpt2_bpe import EOD_TOKEN
from megatron_bridge.runtime.tokenizers.tokenizer import build_tokenizer

logger = logging.getLogger("megatron_bridge")

_CONFIG_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def origin_config(provider: Any, origin: Optional[str]) -> Optional[dict]:
    """The config.json of `origin` if it describes `provider`'s architecture (then it is
    written as is, keeping fields we do not model), else None."""
    if not origin:
        return None
    try:
        hf = read_hf_config(origin)
    except ConfigValidationError:
        return None
    reference = provider_from_hf_config(hf, Problems())
    if reference is None or architecture_differences(provider, reference):
        logger.info("the model differs from %s/config.json: writing a config.json of its own", origin)
        return None
    return hf


def default_dtype(provider: Any, hf: Optional[dict]) -> str:
    """The dtype to export in: the origin's (config.json `torch_dtype`/`dtype`), else the dtype
    the model trains its weights in."""
    if hf is not None:
        named = _CONFIG_DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype")))
        if named:
            return named
    return _CONFIG_DTYPES.get(str(stored_dtype(provider)).replace("torch.", ""), "fp32")


def export_config(provider: Any, origin: Optional[str], dtype: Optional[str]) -> tuple[dict, str]:
    """(config.json to write, dtype) for exporting `provider`'s weights."""
    hf = origin_config(provider, origin)
    if hf is not None:
        hf = family_for_config(hf).exported_config(hf)
    dtype = dtype or default_dtype(provider, hf)

    name = str(torch_dtype(dtype)).replace("torch.", "")
    return (hf if hf is not None else hf_config_from_provider(provider, name)), dtype


# ---------------------------------------------------------------------- HF -> ours
def import_hf(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, dtype: Optional[str] = None,
              backend: str = "auto") -> str:
    """Convert the Hugging Face directory `hf_dir` into a weights-only checkpoint of ours in
    `out_dir` (load it with `checkpoint.pretrained_checkpoint`). Everything is checked before
    the model is built. `backend`: see `runtime.model_parallel`. Returns the iteration directory
    written."""
    import torch.distributed as dist

    problems = Problems(hf_dir)
    provider = check_hf_directory(hf_dir, problems)
    problems.raise_if_any()
    check_replaceable(out_dir, lambda name: name in (os.path.basename(iteration_dir("", 0)), TRACKER_FILE), "an import",
                      "give a new or empty directory: an import there would make its iteration 0 the latest")
    hf = read_hf_config(hf_dir)
    weights_dtype = torch_dtype(dtype or default_dtype(provider, hf))
    with model_parallel(tp=tp, pp=pp, ep=ep, etp=provider.expert_tensor_parallel(tp), backend=backend) as device:
        chunks = build_chunks(prepare(provider, device, params_dtype=weights_dtype), device)
        load_hf_weights(chunks, hf_dir, map_files=True)  # the model is only written out again
        if weights_dtype != provider.params_dtype:
            # the checkpoint holds what a mixed-precision run keeps in its model
            provider.apply_default("bf16" if str(weights_dtype) == "torch.bfloat16" else "fp16", True)
        assets = os.path.join(os.path.abspath(iteration_dir(out_dir, 0)), HF_ASSETS_DIR)  # tokenizer copied there
        config = weights_only_config(provider, assets if has_tokenizer(hf_dir) else None, os.path.abspath(hf_dir))
        directory = save_checkpoint_weights(chunks, out_dir, config, assets=hf_dir)
        if dist.get_rank() == 0:
            logger.info("imported %s into %s", hf_dir, directory)
    return directory


# ---------------------------------------------------------------------- ours -> HF
def checkpoint_provider(directory: str) -> Any:
    """The model provider saved in our checkpoint iteration directory `directory`."""
    saved = read_run_config(directory)
    if saved is None:
        raise ConfigValidationError(_no_config(directory))
    provider = saved.build("model", GPTModelProvider)
    if provider.vocab_size is not None and "vocab_size" in provider.derived_fields():
        # derived from the run's tokenizer, which is not loaded here: the weights have this size
        provider.apply_default("vocab_size", provider.vocab_size)
    return provider


def _no_config(directory: str):
    return ConfigProblem(directory, "no run_config.yaml: the model architecture is unknown",
                         "export a checkpoint written by megatron_bridge (or `mbridge hf import`)")  # fmt: skip


def export_checkpoint(ckpt: str, out_dir: str, dtype: Optional[str] = None, step: Optional[int] = None,
                      tp: int = 1, pp: int = 1, ep: int = 1, max_shard_bytes: Optional[int] = None,
                      base: Optional[str] = None, backend: str = "auto") -> dict:
    """Write the model weights of our checkpoint `ckpt` (a save directory or one iter_*
    directory) as a Hugging Face directory `out_dir` in `dtype` (None: the dtype of the Hugging
    Face model it came from, else of its training weights). The adapters of a LoRA/DoRA
    checkpoint are folded into the base weights they record (or those in `base`). `backend`: see
    `runtime.model_parallel`."""
    directory, _ = resolve(ckpt, step)
    check_replaceable(out_dir, written_by_export, "an export", EXPORT_FIX, staged_beside=True)
    provider = checkpoint_provider(directory)
    peft, base_dir = _adapters_of(directory, base)
    origin = hf_origin(directory) or hf_origin(base_dir)
    with model_parallel(tp=tp, pp=pp, ep=ep, etp=provider.expert_tensor_parallel(tp), backend=backend) as device:
        model = prepare(provider, device, params_dtype=stored_dtype(provider), bf16=False, fp16=False)
        chunks = build_chunks(model, device)
        if peft is None:
            load_checkpoint_weights(chunks, directory)
        else:
            _load_adapted(chunks, peft, base_dir, directory)
        hf, dtype = export_config(model, origin, dtype)
        return write_hf_weights(chunks, out_dir, hf, dtype, tokenizer_source=_tokenizer_source(origin, directory),
                                origin=origin, max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES)  # fmt: skip


def _adapters_of(directory: str, base: Optional[str]) -> tuple[Any, Optional[str]]:
    """(PEFT config, base weights) of a LoRA/DoRA checkpoint iteration `directory`; (None, None)
    for a checkpoint that holds whole weights."""
    if not saved_with_peft(directory):
        return None, None
    _, _, cfg, common = read_adapter_checkpoint(directory)
    return cfg.peft, base_of(cfg, common, base)


def _load_adapted(chunks: list[Any], peft: Any, base_dir: str, adapters_dir: str) -> None:
    """Wrap `chunks` with the adapters of `peft`, fill the base weights from `base_dir` (ours or
    a Hugging Face directory) and the adapters from `adapters_dir`; the writer folds them in."""
    for chunk in chunks:
        apply_peft(chunk, peft)
    if is_hf_directory(base_dir):
        load_hf_weights(chunks, base_dir)
    else:
        load_checkpoint_weights(chunks, resolve(base_dir)[0], "base")
    load_checkpoint_weights(chunks, adapters_dir, "adapters")
    logger.info("folding the adapters of %s into the base weights of %s", adapters_dir, base_dir)


def _tokenizer_source(origin: Optional[str], directory: str) -> Union[None, str, dict[str, Any]]:
    if has_tokenizer(origin):
        return origin
    saved = read_run_config(directory)
    if saved is None or not saved.has_section("tokenizer"):
        return None
    try:
        tok = saved.build("tokenizer", TokenizerConfig)
    except ConfigValidationError as exc:
        logger.warning("the tokenizer is not exported: the run's tokenizer section does not load: %s", exc)
        return None
    return exported_tokenizer(tok)


def exported_tokenizer(tok: Any) -> Union[None, str, dict[str, Any]]:
    """What an export writes as the tokenizer of a run whose tokenizer is `tok` (a
    TokenizerConfig) when the model did not come from Hugging Face: a Hugging Face tokenizer's
    directory or tokenizer.json (copied); GPT-2's BPE as the tokenizer.json of the tokenizer
    the run used (its added special tokens included), which `transformers` loads; a SentencePiece
    model as tokenizer.model. Files as {name: content}. None when there is nothing to write, and
    a warning when the run's tokenizer files are not on this machine."""
    if tok.tokenizer_type == "HuggingFaceTokenizer":
        return tok.tokenizer_model
    if tok.tokenizer_type == "GPT2BPETokenizer":
        try:
            built = build_tokenizer(tok)
        except (OSError, ValueError, ConfigValidationError) as exc:
            logger.warning("the GPT-2 BPE tokenizer is not exported: %s", exc)
            return None
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN}
        return {"tokenizer.json": built._tok.to_str(), "tokenizer_config.json": json.dumps(settings, indent=2)}
    if tok.tokenizer_type in SENTENCEPIECE_TYPES and tok.tokenizer_model:
        try:
            with open(tok.tokenizer_model, "rb") as f:
                return {"tokenizer.model": f.read()}
        except OSError as exc:
            logger.warning("the SentencePiece tokenizer is not exported: %s", exc)
    return None


def save_run(run: Any) -> Optional[str]:
    """`checkpoint.save_hf`: write the model of a finished run as `<save>/hf_iter_NNNNNNN`."""
    cfg = run.state.cfg
    step = run.state.train_state.step
    out_dir = os.path.join(cfg.checkpoint.save, f"hf_iter_{step:07d}")
    if cfg.ddp.use_distributed_optimizer and cfg.ddp.overlap_param_gather:
        for chunk in run.state.model:  # the last step's parameters may not be gathered yet
            chunk.start_param_sync(force_sync=True)
    origin = hf_origin(cfg.checkpoint.pretrained_checkpoint)
    hf, dtype = export_config(cfg.model, origin, cfg.checkpoint.save_hf_dtype)
    tokenizer = origin if has_tokenizer(origin) else exported_tokenizer(cfg.tokenizer)
    write_hf_weights(run.state.model, out_dir, hf, dtype, tokenizer_source=tokenizer, origin=origin)
    if cfg.peft is not None:
        save_run_adapters(cfg, step, out_dir + ADAPTER_SUFFIX)
    return out_dir


ADAPTER_SUFFIX = "_adapter"
"""`save_hf` in a LoRA/DoRA run: `<save>/hf_iter_NNNNNNN` holds the model with the adapters folded
in, `<save>/hf_iter_NNNNNNN_adapter` the adapters alone in the peft library's format."""


def save_run_adapters(cfg: Any, step: int, out_dir: str) -> None:
    """Write the adapters of the PEFT run's checkpoint of iteration `step` to `out_dir` in the
    peft format (rank 0; written under a temporary name, then renamed). Adapters that have no
    peft-format counterpart (on MoE experts) are left out with a warning: the folded model is
    complete without them."""
    import shutil

    import torch.distributed as dist

    if dist.get_rank() == 0:
        checkpoint = iteration_dir(cfg.checkpoint.save, step)
        staging = out_dir + ".incomplete"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            export_adapters(checkpoint, staging)
        except (ValueError, OSError) as exc:  # UnmappedModuleError is a ValueError
            shutil.rmtree(staging, ignore_errors=True)
            logger.warning("the adapters were not written in the peft format: %s", exc)
        else:
            shutil.rmtree(out_dir, ignore_errors=True)
            os.rename(staging, out_dir)
            logger.info("saved the adapters in the peft format to %s", out_dir)
    dist.barrier()
