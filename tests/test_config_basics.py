"""Deferred finalize, user-set tracking, types, idempotency, copying: the config machinery."""

import ast
import copy
import os
import pathlib
import pickle
import subprocess
import sys

import pytest
import torch
from factories import tiny_config, tiny_model

from megatron_bridge.training.config import (
    ConfigValidationError,
    DistributedDataParallelConfig,
    GPTDatasetConfig,
    MockGPTDatasetConfig,
    OptimizerConfig,
    TrainingConfig,
    runtime_config_update,
)

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megatron_bridge"


def test_megatron_core_subclasses_defer_post_init_to_finalize():
    # Values megatron-core would reject at construction are stored; finalize reports them.
    model = tiny_model(num_attention_heads=3, tensor_model_parallel_size=2)
    opt = OptimizerConfig(lr=1e-3, main_grads_dtype=torch.bfloat16)
    ddp = DistributedDataParallelConfig(reuse_grad_buf_for_mxfp8_param_ag=True)
    data = GPTDatasetConfig(seq_length=16, data_path="0.5 a 0.5", num_workers=0)
    for obj, text in [
        (model, "3 heads do not split over tensor_model_parallel_size=2"),
        (opt, "main_grads_dtype: torch.bfloat16 needs the precision-aware optimizer"),
        (ddp, "reusing the grad buffer for the param all-gather needs fp8_param_gather"),
        (data, "cannot tell weights from paths"),
    ]:
        with pytest.raises(ConfigValidationError) as err:
            obj.finalize()
        assert text in str(err.value)


def test_megatron_core_rejections_name_the_field_they_are_about():
    # The field the message names that the user set, else the first it names (a Megatron-LM flag
    # spelled --like-this included); a message naming none stays on the section.
    for fields, path, text in [
        ({"fp4_param": True}, "fp4_param", "True is rejected by megatron-core's TransformerConfig: fp4_param must"),
        ({"recompute_granularity": "full"}, "recompute_granularity", "'full' is rejected by megatron-core's"),
        ({"num_moe_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 1}, "moe_router_pre_softmax",
         "False is rejected by megatron-core's TransformerConfig: Please use --moe-router-pre-softmax"),
        ({"defer_embedding_wgrad_compute": True}, "", "megatron-core rejects this TransformerConfig: Cannot defer"),
    ]:  # fmt: skip
        model = tiny_model(**fields)
        with pytest.raises(ConfigValidationError) as err:
            model.finalize()
        (problem,) = err.value.problems
        assert (problem.path, problem.message[: len(text)]) == (path, text)
        assert problem.fix == (f"change {path}, or the other fields the message names" if path else "change the fields it names")


def test_finalize_is_idempotent_and_raises_again_after_a_bad_edit():
    model = tiny_model()
    model.finalize()
    state = copy.deepcopy(model)
    model.finalize()
    assert model == state
    model.num_attention_heads = 5
    with pytest.raises(ConfigValidationError, match="hidden_size 64 is not a multiple of num_attention_heads 5"):
        model.finalize()


def test_derived_values_are_recomputed_after_an_edit_but_user_values_are_kept():
    model = tiny_model()
    model.finalize()
    assert model.ffn_hidden_size == 256 and model.kv_channels == 16
    model.hidden_size = 128
    model.finalize()
    assert model.ffn_hidden_size == 512 and model.kv_channels == 32
    model.ffn_hidden_size = 100  # the user's own value is never recomputed
    model.hidden_size = 256
    model.finalize()
    assert model.ffn_hidden_size == 100


def test_container_has_no_derived_values_before_runtime_update():
    cfg = tiny_config()
    assert cfg.data_parallel_size is None and cfg.scheduler.lr_decay_steps is None
    runtime_config_update(cfg)
    assert cfg.data_parallel_size == 1 and cfg.scheduler.lr_decay_steps == 20 * 8


def test_runtime_config_update_is_idempotent():
    cfg = tiny_config(mixed_precision="bf16_mixed")
    runtime_config_update(cfg, world_size=4)
    once = copy.deepcopy(cfg)
    runtime_config_update(cfg, world_size=4)
    assert cfg == once
    assert cfg.data_parallel_size == 4


def test_train_iters_derived_from_train_samples_stays_idempotent():
    cfg = tiny_config(train=TrainingConfig(train_samples=100, global_batch_size=8, micro_batch_size=2))
    runtime_config_update(cfg)
    assert cfg.train.train_iters == 12  # 100 // 8, as Megatron-LM counts: whole batches only
    runtime_config_update(cfg)  # the derived train_iters must not count as "both set"
    assert cfg.train.train_iters == 12


def test_explicit_fields_are_tracked_from_constructor_and_assignment():
    train = TrainingConfig(train_iters=5, global_batch_size=8)
    assert train.is_explicit("train_iters") and not train.is_explicit("micro_batch_size")
    train.micro_batch_size = None  # equal to the default but set: still the user's
    assert train.is_explicit("micro_batch_size")


@pytest.mark.parametrize(
    "make, text",
    [
        (lambda: TrainingConfig(train_iters="abc"), "TrainingConfig.train_iters: expected Optional[int], got str 'abc'"),
        (lambda: TrainingConfig(manual_gc=1), "TrainingConfig.manual_gc: expected bool, got int 1"),
        (lambda: OptimizerConfig(params_dtype="bf16"), "OptimizerConfig.params_dtype: expected dtype, got str 'bf16'"),
        (lambda: tiny_model(normalization="BatchNorm"), "expected one of ['LayerNorm', 'RMSNorm'], got 'BatchNorm'"),
    ],
)
def test_wrong_types_raise_type_error_at_construction(make, text):
    with pytest.raises(TypeError) as err:
        make()
    assert text in str(err.value)


def test_wrong_type_on_assignment_is_refused_and_not_stored():
    cfg = tiny_config()
    with pytest.raises(TypeError, match="expected Optional\\[int\\], got str '10'"):
        cfg.train.train_iters = "10"
    assert cfg.train.train_iters == 20


def test_wrong_types_inside_a_mapping_are_refused_and_not_stored():
    """A dict field checks its keys and values against the declaration, as a list field checks its
    items: an int tag would be stored as given, and read back from YAML as a string."""
    from megatron_bridge.training.config import ConfigContainer, LoggerConfig

    with pytest.raises(TypeError, match=r"LoggerConfig.mlflow_tags: expected Optional\[dict\[str, str\]\], got dict \{'team': 1\}"):
        LoggerConfig(mlflow_tags={"team": 1})
    logger = LoggerConfig(mlflow_tags={"team": "llm"})
    with pytest.raises(TypeError, match="expected Optional"):
        logger.mlflow_tags = {"team": 1}
    assert logger.mlflow_tags == {"team": "llm"}
    with pytest.raises(TypeError, match=r"ConfigContainer.env_vars: key 1: expected str, got int 1"):
        tiny_config(env_vars={1: "x"})
    with pytest.raises(TypeError, match=r"sequences_per_dataset: expected .*, got dict \{'a': 'many'\}"):
        GPTDatasetConfig(seq_length=8, sequences_per_dataset={"a": "many"})
    cfg = tiny_config(logger=logger, env_vars={"A": 1})
    assert ConfigContainer.from_dict(cfg.to_dict()) == cfg


def test_dataset_seq_length_alias():
    data = GPTDatasetConfig(seq_length=128)
    assert data.sequence_length == 128 and data.seq_length == 128
    data.seq_length = 64
    assert data.sequence_length == 64 and data.is_explicit("sequence_length")


def test_deepcopy_and_pickle_of_a_resolved_container():
    cfg = tiny_config(mixed_precision="bf16_mixed")
    runtime_config_update(cfg)
    for clone in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert clone == cfg
        assert clone.model.is_explicit("num_layers") and not clone.model.is_explicit("bf16")


def test_config_error_pickles_and_lists_problems():
    cfg = tiny_config()
    cfg.optimizer.lr = None
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg)
    again = pickle.loads(pickle.dumps(err.value))
    assert again.errors == err.value.errors == ["optimizer.lr: the learning rate is not set (set optimizer.lr, e.g. 3e-4)"]
    assert isinstance(err.value, ValueError)


def test_log_non_default_values_reports_only_changed_fields(caplog):
    cfg = tiny_config()
    runtime_config_update(cfg)
    with caplog.at_level("INFO"):
        report = cfg.log_non_default_values()
    assert report["model"]["num_layers"] == (2, 0)  # megatron-core's default
    assert report["model"]["transformer_impl"] == ("local", "transformer_engine")
    assert "ffn_hidden_size" not in report["model"]  # derived, not chosen
    assert "gated_linear_unit" not in report["model"]  # unchanged
    assert report["train"]["train_iters"] == (20, None)
    assert "rng" not in report
    assert "num_layers=2 (default 0)" in caplog.text


def test_no_assert_statements_in_the_library():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert offenders == []


def test_importing_the_config_layer_does_not_import_the_runtime_or_optional_packages():
    # megatron.core itself imports wandb/tensorboard when they are installed (timers.py), so
    # compare against what `import megatron.core` alone loads.
    code = (
        "import sys, megatron.core\n"
        "before = set(sys.modules)\n"
        "import megatron_bridge.training.config, megatron_bridge.models\n"
        "new = set(sys.modules) - before\n"
        "heavy = sorted(m for m in new if m.startswith(('megatron_bridge.training.pretrain', "
        "'megatron_bridge.training.train', 'megatron_bridge.training.setup', 'megatron_bridge.training.checkpointing', "
        "'megatron_bridge.training.loggers', 'transformer_engine', 'nvidia_resiliency_ext', 'mlflow', 'wandb', "
        "'comet_ml', 'tensorboard', 'megatron.core.models.gpt.gpt_model')))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_min_lr_defaults_to_zero_and_stays_derived():
    cfg = tiny_config()
    cfg.optimizer.min_lr = None
    runtime_config_update(cfg)
    assert cfg.optimizer.min_lr == 0.0 and "min_lr" in cfg.optimizer.derived_fields()
    cfg.optimizer.min_lr = 1e-4
    runtime_config_update(cfg)
    assert cfg.optimizer.min_lr == 1e-4


def test_a_path_name_over_255_bytes_is_refused_however_short_the_text():
    """The limit is in bytes: 100 three-byte characters make one 300-byte name."""
    from megatron_bridge.config.errors import Problems
    from megatron_bridge.config.paths import check
    from megatron_bridge.training.config import CheckpointConfig

    for save, bytes_ in (("/tmp/" + "é" * 128, 256), ("runs/" + "名" * 100 + "/x", 300), ("n" * 256, 256)):
        problems = Problems()
        check(CheckpointConfig(save=save), problems)
        assert [p.path for p in problems] == ["save"], save
        assert f"is {bytes_:,} bytes, over the 255 bytes a filesystem allows" in problems.items[0].message
    for fine in ("/tmp/" + "é" * 127, "runs/" + "名" * 85, "a/" * 200):
        problems = Problems()
        check(CheckpointConfig(save=fine), problems)
        assert not problems, fine


def test_a_path_with_control_characters_is_refused():
    """An escape sequence or a newline in a path (from a shared config) would reach the terminal
    and the logs as it is when the path is printed: refused, like a run name with them."""
    from megatron_bridge.config.errors import Problems
    from megatron_bridge.config.paths import check
    from megatron_bridge.training.config import CheckpointConfig, LoggerConfig

    problems = Problems()
    check(CheckpointConfig(save="runs/x\x1b[2J", load="runs/x\nsaved checkpoint of iteration 9"), problems)
    check(LoggerConfig(tensorboard_dir="tb\x9b31m"), problems)
    fix = "(use a path without control characters (they would reach terminals and logs as they are))"
    assert [str(p) for p in problems] == [
        f"save: 'runs/x\\x1b[2J' has a control character ('\\x1b') {fix}",
        f"load: 'runs/x\\nsaved checkpoint of iteration 9' has a control character ('\\n') {fix}",
        f"tensorboard_dir: 'tb\\x9b31m' has a control character ('\\x9b') {fix}",
    ]
    for fine in ("runs/café ✓/x", "/data/a b/c"):
        problems = Problems()
        check(CheckpointConfig(save=fine), problems)
        assert not problems, fine


def test_a_path_that_is_not_utf8_is_refused():
    """A directory named in Latin-1 reaches Python with the byte as a lone surrogate; the run
    could not write it into its UTF-8 files (the checkpoint's run_config.yaml), so the first save
    would fail after the training before it: refused with the config."""
    from megatron_bridge.config.errors import Problems
    from megatron_bridge.config.paths import check
    from megatron_bridge.training.config import CheckpointConfig

    problems = Problems()
    check(CheckpointConfig(save=os.fsdecode(b"runs/caf\xe9/checkpoints")), problems)
    assert [str(p) for p in problems] == [
        "save: 'runs/caf\\udce9/checkpoints' has a byte that is not UTF-8 text (b'\\xe9') (use a path in UTF-8: the run "
        "writes its paths into UTF-8 files (run_config.yaml, tracker logs))"
    ]


def test_positional_constructor_arguments_are_named_checked_and_tracked():
    mock = MockGPTDatasetConfig(32)  # the sequence length, as in Megatron Bridge's signature
    assert mock.sequence_length == 32 and mock.explicit_fields() == {"sequence_length"}
    data = GPTDatasetConfig(64, False, "/data/a")
    assert (data.sequence_length, data.skip_getting_attention_mask_from_dataset, data.data_path) == (64, False, "/data/a")
    assert OptimizerConfig(1e-3).explicit_fields() == {"lr"}  # megatron-core's own order
    refusals = {
        "MockGPTDatasetConfig takes at most 1 positional arguments ('seq_length',), got 2": lambda: MockGPTDatasetConfig(32, 5),
        "MockGPTDatasetConfig.sequence_length: expected Optional[int], got str 'x'": lambda: MockGPTDatasetConfig("x"),
        "MockGPTDatasetConfig: got 'seq_length' both as positional and keyword argument": lambda: MockGPTDatasetConfig(32, seq_length=3),
        "TrainingConfig takes keyword arguments only, got 1 positional": lambda: TrainingConfig(5),
    }  # fmt: skip
    for message, make in refusals.items():
        with pytest.raises(TypeError) as err:
            make()
        assert str(err.value) == message


def test_field_aliases_read_and_write_the_field():
    from megatron_bridge.training.config import CheckpointConfig, DistributedInitConfig

    checkpoint = CheckpointConfig(save_hf_weights=True)
    assert checkpoint.save_hf is True and checkpoint.save_hf_weights is True
    with pytest.raises(AttributeError, match="'CheckpointConfig' object has no attribute 'save_hf_weight'"):
        checkpoint.save_hf_weight
    dist = DistributedInitConfig()
    assert dist.lazy_init is False
    dist.lazy_init = False
    assert dist.is_explicit("lazy_mpu_init")
    with pytest.raises(ConfigValidationError) as err:
        DistributedInitConfig(lazy_init=True).finalize()
    assert err.value.errors[0].startswith("lazy_mpu_init: lazy_mpu_init=True is not supported")


def test_bare_set_annotations_take_sets_and_their_own_decoding():
    import dataclasses

    from megatron_bridge.config.base import ConfigBase, config_dataclass
    from megatron_bridge.config.codec import Decoder

    @config_dataclass
    class Tags(ConfigBase):
        names: set = dataclasses.field(default_factory=set)
        frozen: frozenset = frozenset()

    tags = Tags(names={"a"}, frozen=frozenset({1}))
    tags.names = Decoder().value(["b", "c"], set)  # what a YAML list decodes to for this field
    assert tags.names == {"b", "c"} and tags.frozen == frozenset({1})
    with pytest.raises(TypeError, match="expected set, got str 'abc'"):
        tags.names = "abc"


def test_hf_tokenizer_kwargs_may_be_none():
    # the reference system's TokenizerConfig takes None for "no extra arguments"
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    tok = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=10, hf_tokenizer_kwargs=None)
    tok.finalize()
    assert tok.hf_tokenizer_kwargs is None
