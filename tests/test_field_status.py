"""Every config field is used, derived, or unsupported (with a reason); unsupported settings are
refused (machine-only reasons at run time, not in a dry run); the unsupported list in the docs is
current; fields inherited from megatron-core reach the objects megatron-core builds."""

from __future__ import annotations

import ast
import dataclasses
import glob
import os
import pathlib
import re

import pytest
import yaml

from megatron_bridge.config import status as field_status
from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.config.field_catalog import config_classes, declared_fields, unsupported_markdown

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _test_sources() -> dict[str, str]:
    found = {}
    for path in sorted(glob.glob(os.path.join(REPO, "tests", "test_*.py"))):
        src = pathlib.Path(path).read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                found[f"tests/{os.path.basename(path)}::{node.name}"] = ast.get_source_segment(src, node) or ""
    return found


def test_every_field_has_exactly_one_status():
    fields = declared_fields()
    assert len(fields) > 600  # the container, every section, model providers with megatron-core's fields
    for (owner, name), (cls, status) in fields.items():
        assert status in (field_status.USED, field_status.DERIVED) or (
            isinstance(status, field_status.Unsupported) and status.reason
        ), f"{owner}.{name}: {status!r}"
    classes = {c.__name__: c for c in config_classes()}
    for cls_name in ("ConfigContainer", "GPTModelProvider", "LoRA", "DoRA", "TokenizerConfig", "GPTDatasetConfig"):
        assert cls_name in classes
    # No stale entries: every declared unsupported field exists on its class.
    for cls_name, table in field_status.UNSUPPORTED.items():
        for name in table:
            assert name in classes[cls_name].__dataclass_fields__, f"{cls_name}.{name} is not a field"


def test_used_fields_are_named_by_a_test():
    tests = _test_sources()
    untested = set()
    for (owner, name), (cls, status) in declared_fields().items():
        if status != field_status.USED or field_status.from_megatron_core(cls, name):
            continue  # inherited megatron-core fields: test_megatron_core_fields_reach_megatron_core
        pattern = re.compile(rf"\b{re.escape(name)}\b")
        if not any(pattern.search(src) for src in tests.values()):
            untested.add(f"{owner}.{name}")
    assert not untested, f"used fields without a test that shows their effect: {sorted(untested)}"
    assert field_status.GENERIC_MCORE_TEST.split("::")[1] in {
        n.name
        for n in ast.walk(ast.parse(pathlib.Path(__file__).read_text(encoding="utf-8")))
        if isinstance(n, ast.FunctionDef)
    }


def test_unsupported_doc_is_current():
    with open(os.path.join(REPO, "docs", "unsupported-fields.md"), encoding="utf-8") as fh:
        assert fh.read() == unsupported_markdown(), "run: python tools/gen_unsupported_fields.py"


# ---------------------------------------------------------------------- refusals
def test_unsupported_settings_are_refused_together():
    from megatron_bridge.training.config import CheckpointConfig, runtime_config_update
    from tests.factories import tiny_config

    cfg = tiny_config(checkpoint=CheckpointConfig(ckpt_format="zarr", non_persistent_save_interval=10))
    cfg.train.train_sync_interval = 5
    with pytest.raises(ConfigValidationError) as info:
        runtime_config_update(cfg)
    text = str(info.value)
    assert "checkpoint.ckpt_format" in text and "'zarr'" in text and "zarr is deprecated in megatron-core" in text
    assert (
        "checkpoint.non_persistent_save_interval" in text and "non-persistent checkpoints are not implemented" in text
    )
    assert "train.train_sync_interval" in text and "5" in text


def test_defaults_of_unsupported_fields_are_accepted():
    from megatron_bridge.training.config import CheckpointConfig, runtime_config_update
    from tests.factories import tiny_config

    runtime_config_update(tiny_config(checkpoint=CheckpointConfig(ckpt_format="torch_dist")))


def test_fim_dataset_is_refused():
    from megatron_bridge.training.config import GPTFIMDatasetConfig, runtime_config_update
    from tests.factories import tiny_config

    cfg = tiny_config(dataset=GPTFIMDatasetConfig(seq_length=32, fim_rate=0.5, num_workers=0))
    with pytest.raises(ConfigValidationError) as info:
        runtime_config_update(cfg)
    text = str(info.value)
    assert "GPTFIMDatasetConfig is not supported: megatron-core 0.16.1 has no fill-in-the-middle dataset" in text
    assert "dataset.fim_rate" in text and "0.5" in text


def test_machine_only_reasons_plan_in_dry_run_and_refuse_at_run(capsys, monkeypatch):
    """model.fp8 needs TransformerEngine: the dry run prints the same YAML with or without it,
    plus a "would fail on this machine" line; the run refuses it before building anything."""
    from megatron_bridge import extras
    from megatron_bridge.cli.main import main

    argv = [
        "pretrain",
        "--recipe",
        "llama3_8b_pretrain",
        "--dry-run",
        "--world-size",
        "8",
        "mixed_precision=bf16_with_fp8_current_scaling_mixed",
    ]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "# would fail on this machine: model.fp8: fp8='hybrid' needs TransformerEngine" in out
    monkeypatch.setattr(extras, "is_installed", lambda name: True)
    code = main(argv)
    out_with_te, err = capsys.readouterr()
    assert code == 0, err
    assert "would fail on this machine: model.fp8" not in out_with_te
    assert yaml.safe_load(out) == yaml.safe_load(out_with_te)
    monkeypatch.undo()

    import recipes

    cfg = recipes.get_recipe("llama3_8b_pretrain")()
    cfg.model.fp8 = "hybrid"
    with pytest.raises(ConfigValidationError, match=r"model\.fp8: fp8='hybrid' needs TransformerEngine"):
        field_status.refuse_on_this_machine(cfg)


# ---------------------------------------------------------------------- effects
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step tiny run that also writes its resolved config."""
    from megatron_bridge.training.config import TrainingConfig
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain
    from tests.factories import tiny_config

    path = tmp_path_factory.mktemp("cfg") / "sub" / "resolved.yaml"
    cfg = tiny_config(train=TrainingConfig(train_iters=2, global_batch_size=8, micro_batch_size=2))
    cfg.logger.save_config_filepath = str(path)
    cfg.validation.eval_interval = None
    from megatron_bridge.training.callbacks import Callback

    class Keep(Callback):
        """Keeps what megatron-core was built with (the state drops it at shutdown)."""

        def on_train_end(self, state):
            self.model, self.optimizer = state.model, state.optimizer

    kept = Keep()
    pretrain(cfg, forward_step, callbacks=[kept])
    return cfg, kept, path


@pytest.mark.timeout(300)
def test_save_config_filepath_writes_the_resolved_yaml(trained):
    """`logger.save_config_filepath`: rank 0 writes the resolved config at setup (directories made)."""
    from megatron_bridge.training.config.serialization import from_yaml

    cfg, _, path = trained
    assert path.exists()
    loaded = from_yaml(str(path))
    assert loaded.data_parallel_size == 1  # derived at setup
    assert loaded.model.vocab_size == cfg.model.vocab_size == 256  # filled in from the tokenizer
    assert loaded.train.train_iters == 2


@pytest.mark.timeout(300)
def test_megatron_core_fields_reach_megatron_core(trained):
    """The model is built with a copy of the provider as its TransformerConfig, megatron-core's
    DDP with our ddp section, and the optimizer with our optimizer section: every inherited field
    that is not derived has the value the user set where megatron-core reads it."""
    cfg, state, _ = trained
    chunk = state.model[0]  # what the run trained (kept by a callback)
    module = chunk.module if hasattr(chunk, "module") else chunk
    while hasattr(module, "module"):
        module = module.module
    mcore_objects = [(cfg.model, module.config), (cfg.ddp, chunk.ddp_config), (cfg.optimizer, state.optimizer.config)]
    for ours, theirs in mcore_objects:
        names = [
            f.name
            for f in dataclasses.fields(ours)
            if field_status.from_megatron_core(type(ours), f.name)
            and field_status.status_of(type(ours), f.name) == field_status.USED
        ]
        assert len(names) > 10
        for name in names:
            assert getattr(theirs, name) is getattr(ours, name) or getattr(theirs, name) == getattr(ours, name), name
    assert type(module.config) is type(cfg.model)


@pytest.mark.timeout(120)
def test_megatron_core_dataset_fields_reach_the_dataset():
    """megatron-core's dataset builder gets a copy of our dataset section (plus the tokenizer)."""
    from megatron_bridge.data.builders import build_datasets
    from megatron_bridge.training.config import runtime_config_update
    from megatron_bridge.runtime.tokenizers.tokenizer import build_tokenizer
    from tests.factories import tiny_config

    cfg = tiny_config()
    cfg.dataset.random_seed = 4321
    runtime_config_update(cfg)
    train, _, _ = build_datasets(cfg, build_tokenizer(cfg.tokenizer))
    names = [
        f.name for f in dataclasses.fields(cfg.dataset) if field_status.from_megatron_core(type(cfg.dataset), f.name)
    ]
    assert len(names) > 10 and train.config.random_seed == 4321
    # skip_getting_attention_mask_from_dataset (on by default) stops the dataset building masks.
    assert cfg.dataset.skip_getting_attention_mask_from_dataset and cfg.dataset.create_attention_mask
    assert train.config.create_attention_mask is False
    # Filled in for the builder: the tokenizer, its token width, and (skip_getting_attention_mask_from_dataset)
    # whether the dataset builds attention masks.
    for name in set(names) - {"tokenizer", "token_dtype_code", "create_attention_mask"}:
        assert getattr(train.config, name) == getattr(cfg.dataset, name), name


# ---------------------------------------------------------------------- typos
def test_assigning_an_unknown_field_names_the_closest():
    from tests.factories import tiny_config

    cfg = tiny_config()
    with pytest.raises(AttributeError, match=r"OptimizerConfig has no field 'learning_rate'; did you mean lr\?"):
        cfg.optimizer.learning_rate = 1e-3
    with pytest.raises(AttributeError, match=r"TrainingConfig has no field 'train_iter'; did you mean train_iters"):
        cfg.train.train_iter = 5
    with pytest.raises(AttributeError, match=r"ConfigContainer has no field 'optimiser'; did you mean optimizer"):
        cfg.optimiser = None
    assert cfg.optimizer.lr == 3e-3 and cfg.train.train_iters == 20
    cfg.train._scratch = 1  # private bookkeeping stays allowed
    cfg.dataset.seq_length = 32  # an alias of a field still works
    assert cfg.dataset.sequence_length == 32


def test_gpu_only_settings_are_refused_before_the_build_on_a_cpu_machine():
    import torch

    from tests.factories import tiny_config

    cfg = tiny_config()
    cfg.model.enable_cuda_graph = True
    on_cpu = field_status.machine_problems(cfg, device="cpu")  # a gloo run: refused on every machine
    assert len(on_cpu) == 1 and on_cpu[0].startswith("model.enable_cuda_graph: enable_cuda_graph=True needs a GPU (CUDA graphs) (")
    found = field_status.machine_problems(cfg)
    if torch.cuda.is_available():
        assert found == []
    else:
        assert found == [
            "model.enable_cuda_graph: enable_cuda_graph=True needs a GPU (CUDA graphs) (run on a machine with a GPU, or leave it unset)"
        ]


@pytest.mark.timeout(120)
def test_the_run_refuses_machine_problems_before_building(monkeypatch):
    from megatron_bridge.training import build
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain
    from tests.factories import on_cpu, tiny_config

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(build, "build_model", no_build)
    cfg = on_cpu(tiny_config())  # a CPU run: without a GPU, or on a machine with GPUs left unused
    cfg.model.external_cuda_graph = True
    with pytest.raises(
        ConfigValidationError, match=r"model\.external_cuda_graph: external_cuda_graph=True needs a GPU"
    ):
        pretrain(cfg, forward_step)
