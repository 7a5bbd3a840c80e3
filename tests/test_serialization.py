"""YAML serialization: lossless round trips, readable forms, explicit-field bookkeeping, the
`_target_` allowlist, and the errors a user can cause when loading."""

import copy
import dataclasses
import functools
import pathlib
import pickle
import signal

import pytest
import torch
import yaml
from factories import tiny_config
from megatron.core.transformer.enums import AttnBackend, CudaGraphScope

from megatron_bridge.config.base import ConfigBase, config_dataclass, values_equal
from megatron_bridge.peft import DoRA
from megatron_bridge.training.config import (
    ConfigContainer,
    ConfigValidationError,
    DatasetProvider,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    MockGPTDatasetConfig,
    TensorInspectConfig,
    TrainingConfig,
    runtime_config_update,
)
from megatron_bridge.config import targets
from megatron_bridge.config.serialization import from_dict, from_yaml, to_dict, to_yaml
from megatron_bridge.training.mixed_precision import MixedPrecisionConfig


def make_config() -> ConfigContainer:
    return tiny_config(mixed_precision="bf16_mixed")


def reload(cfg, tmp_path, **kw):
    path = tmp_path / "cfg.yaml"
    to_yaml(cfg, path)
    return ConfigContainer.from_yaml(path, **kw)


def assert_same_config(a, b):
    """Equal field by field, with the same record of which fields the user set."""
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            assert_same_config(x, y)
        else:
            assert values_equal(x, y), f"{type(a).__name__}.{f.name}: {x!r} != {y!r}"
            assert type(x) is type(y), f"{type(a).__name__}.{f.name}: {type(x)} != {type(y)}"
    if hasattr(a, "explicit_fields"):
        assert a.explicit_fields() == b.explicit_fields(), type(a).__name__
    assert a == b


# ---------------------------------------------------------------------- round trips
def test_round_trip_before_runtime_update(tmp_path):
    cfg = make_config()
    assert_same_config(cfg, reload(cfg, tmp_path))


def test_round_trip_after_runtime_update(tmp_path):
    cfg = make_config()
    runtime_config_update(cfg)
    loaded = reload(cfg, tmp_path)
    assert_same_config(cfg, loaded)
    assert isinstance(loaded.model.init_method, functools.partial)
    assert loaded.model.init_method.func is torch.nn.init.normal_
    assert loaded.model.init_method.keywords == {"mean": 0.0, "std": 0.02}
    assert loaded.scheduler.lr_decay_steps == cfg.scheduler.lr_decay_steps is not None
    assert loaded.dataset.split_matrix == cfg.dataset.split_matrix
    assert loaded.dataset.mock is True and loaded.data_parallel_size == 1


def test_reloaded_runtime_config_updates_to_the_same_result(tmp_path):
    cfg = make_config()
    runtime_config_update(cfg)
    loaded = reload(cfg, tmp_path)
    runtime_config_update(loaded)
    assert_same_config(cfg, loaded)


def test_a_sample_based_run_switched_from_iterations_reloads_and_resolves_again(tmp_path):
    """`train.train_iters=null train.train_samples=N` on a recipe: train_iters, set to None by the
    user and derived from the samples, is saved as derived, so the saved config (a run's
    run_config.yaml) resolves again instead of holding both lengths."""
    cfg = tiny_config()
    cfg.train.train_iters, cfg.train.train_samples = None, 160
    runtime_config_update(cfg)
    assert cfg.train.train_iters == 20
    loaded = reload(cfg, tmp_path)
    assert loaded.to_dict() == cfg.to_dict() and not loaded.train.is_explicit("train_iters")
    runtime_config_update(loaded)
    assert loaded.to_dict() == cfg.to_dict()
    loaded.train.train_samples = 320
    runtime_config_update(loaded)
    assert loaded.train.train_iters == 40  # recomputed, as before saving


def test_derived_values_are_recomputed_after_reload(tmp_path):
    # A finalized config saved and reloaded still recomputes ffn_hidden_size from hidden_size.
    cfg = make_config()
    runtime_config_update(cfg)
    assert cfg.model.ffn_hidden_size == 4 * 64
    loaded = reload(cfg, tmp_path)
    loaded.model.hidden_size = 128
    runtime_config_update(loaded)
    assert loaded.model.ffn_hidden_size == 4 * 128


def test_round_trip_of_every_value_kind(tmp_path):
    cfg = make_config()
    cfg.model.activation_func = torch.nn.functional.silu
    cfg.model.init_method = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02)
    cfg.model.output_layer_init_method = functools.partial(torch.nn.init.uniform_, -0.1, b=0.1)
    cfg.model.attention_backend = AttnBackend.flash
    cfg.model.cuda_graph_scope = [CudaGraphScope.attn, CudaGraphScope.mlp]
    cfg.model.params_dtype = torch.bfloat16
    cfg.model.autocast_dtype = torch.float16
    cfg.model.window_size = (128, 0)
    cfg.model.moe_layer_freq = [1, 0]
    cfg.train.exit_signal = signal.SIGINT
    cfg.train.rampup_batch_size = [16, 16, 1000]
    cfg.ddp.param_name_patterns_for_fp32_local_accumulation = ("*.bias", "all")
    cfg.logger.mlflow_tags = {"team": "llm"}
    # env_vars is typed dict[str, Any]: its values show how untyped data round-trips
    cfg.env_vars = {"A": 1, "B": "x", "C": 1.5, "D": True, "rank": 8, "dtype": torch.bfloat16, "shape": (1, 2), "path": pathlib.Path("/x"), "fn": torch.relu}  # fmt: skip
    cfg.peft = DoRA(dim=8, target_modules=["linear_qkv", "*.layers.1.*"])
    cfg.tensor_inspect = TensorInspectConfig(features=pathlib.Path("/features.yaml"))
    cfg.checkpoint.save = "/tmp/save"
    assert_same_config(cfg, reload(cfg, tmp_path))


def test_round_trip_of_finetuning_dataset_with_path(tmp_path):
    cfg = tiny_config(dataset=FinetuningDatasetConfig(dataset_root=pathlib.Path("/data/sft"), seq_length=32))
    loaded = reload(cfg, tmp_path)
    assert loaded.dataset.dataset_root == pathlib.Path("/data/sft")
    assert_same_config(cfg, loaded)


def test_to_dict_from_dict_round_trip_without_files():
    cfg = make_config()
    runtime_config_update(cfg)
    assert_same_config(cfg, ConfigContainer.from_dict(cfg.to_dict()))
    assert_same_config(cfg, from_dict(to_dict(cfg)))  # the top-level _target_ names the class


def test_copy_and_pickle_of_a_reloaded_config(tmp_path):
    loaded = reload(make_config(), tmp_path)
    assert_same_config(loaded, copy.deepcopy(loaded))
    assert_same_config(loaded, pickle.loads(pickle.dumps(loaded)))


# ---------------------------------------------------------------------- readable YAML
def test_yaml_is_readable(tmp_path):
    cfg = make_config()
    runtime_config_update(cfg)
    cfg.model.activation_func = torch.nn.functional.silu
    text = cfg.to_yaml()
    data = yaml.safe_load(text)
    model = data["model"]
    assert data["_target_"] == "megatron_bridge.ConfigContainer"
    assert model["_target_"] == "megatron_bridge.models.GPTModelProvider"
    assert model["params_dtype"] == "bfloat16"
    assert model["activation_func"] == "torch.nn.functional.silu"
    assert model["attention_backend"] == "auto"
    assert model["init_method"] == {"_target_": "torch.nn.init.normal_", "_partial_": True, "mean": 0.0, "std": 0.02}
    assert data["train"]["exit_signal"] == "SIGTERM"
    assert data["ddp"]["param_name_patterns_for_fp32_local_accumulation"] == []
    assert "profile_ranks: [0]" in text  # short lists on one line
    assert "params_dtype: bfloat16" in text


def test_ambiguous_declarations_get_tagged_forms():
    cfg = make_config()
    cfg.env_vars = {"T": (1, 2), "dtype": torch.float16, "where": pathlib.Path("/p")}
    cfg.tensor_inspect = TensorInspectConfig(features=pathlib.Path("/f.yaml"))
    data = to_dict(cfg)
    assert data["env_vars"] == {
        "T": {"_tuple_": [1, 2]}, "dtype": {"_target_": "torch.float16", "_call_": False}, "where": {"_path_": "/p"}
    }  # fmt: skip
    assert data["tensor_inspect"]["features"] == {"_path_": "/f.yaml"}  # Union[dict, str, Path]


@config_dataclass(kw_only=True)
class SetFieldsConfig(ConfigBase):
    """A user's section with set-typed fields."""

    tags: set[str] = dataclasses.field(default_factory=set)
    ids: frozenset[int] = frozenset()


def test_set_fields_take_sets_and_round_trip_as_sorted_lists(tmp_path):
    cfg = SetFieldsConfig(tags={"b", "a"}, ids=frozenset({3, 1}))
    text = to_yaml(cfg, tmp_path / "sets.yaml")
    assert "tags: [a, b]" in text and "ids: [1, 3]" in text
    back = from_yaml(tmp_path / "sets.yaml")
    assert back == cfg and type(back.tags) is set and type(back.ids) is frozenset
    with pytest.raises(TypeError, match=r"SetFieldsConfig.tags: item 1: expected str, got int 1"):
        SetFieldsConfig(tags={1})


def test_print_yaml(capsys):
    make_config().print_yaml()
    assert "train:\n  _target_: megatron_bridge.training.config.TrainingConfig" in capsys.readouterr().out


def test_to_yaml_returns_text_and_writes_the_file(tmp_path):
    path = tmp_path / "sub" / "cfg.yaml"
    text = make_config().to_yaml(path)
    assert path.read_text() == text


# ---------------------------------------------------------------------- explicit fields
def test_explicit_default_values_are_listed_and_survive(tmp_path):
    cfg = make_config()
    cfg.model.bf16 = False  # the user's choice, equal to the default
    data = to_dict(cfg)
    assert data["model"]["_explicit_"] == ["bf16"]
    assert "_explicit_" not in data["logger"]  # omitted when empty
    loaded = reload(cfg, tmp_path)
    assert loaded.model.is_explicit("bf16")
    # ...so the preset still reports the contradiction, as it does for the original.
    for c in (cfg, loaded):
        with pytest.raises(ConfigValidationError, match=r"model\.bf16: False was set explicitly"):
            runtime_config_update(c)


def test_preset_values_are_not_explicit_after_reload(tmp_path):
    cfg = make_config()
    runtime_config_update(cfg)
    assert not cfg.model.is_explicit("params_dtype")
    data = to_dict(cfg)
    assert "params_dtype" in data["model"]["_implicit_"]
    assert "ffn_hidden_size" in data["model"]["_derived_"]
    loaded = reload(cfg, tmp_path)
    assert not loaded.model.is_explicit("params_dtype")
    # A different preset may still change it.
    loaded.mixed_precision = "fp16_mixed"
    runtime_config_update(loaded)
    assert loaded.model.params_dtype == torch.float16


def test_section_with_target_counts_non_default_values_as_explicit():
    data = {
        "_target_": "megatron_bridge.training.config.TrainingConfig",
        "_implicit_": ["micro_batch_size"],
        "train_iters": 10,
        "micro_batch_size": 2,
        "manual_gc": False,
    }
    train = from_dict(data)
    assert train.explicit_fields() == {"train_iters"}


def test_hand_written_section_counts_every_key_as_explicit():
    train = from_dict({"train_iters": 10, "manual_gc": False}, TrainingConfig)
    assert train.explicit_fields() == {"train_iters", "manual_gc"}
    assert train.global_batch_size is None  # missing keys take the defaults


def test_old_yaml_missing_fields_loads_with_defaults(tmp_path):
    cfg = make_config()
    runtime_config_update(cfg)
    data = to_dict(cfg)
    del data["scheduler"]["lr_decay_steps"]  # an init=False field
    del data["model"]["rotary_base"]
    del data["logger"]
    del data["data_parallel_size"]
    loaded = from_dict(data, ConfigContainer)
    assert loaded.scheduler.lr_decay_steps is None
    assert loaded.model.rotary_base == 10000
    assert loaded.logger.log_interval == 100
    assert loaded.data_parallel_size is None


def test_hand_written_yaml_with_aliases_and_yaml_spellings(tmp_path):
    path = tmp_path / "hand.yaml"
    path.write_text(
        """
train: {train_iters: 10, global_batch_size: 8, micro_batch_size: 2}
model:
  num_layers: 2
  hidden_size: 64
  num_attention_heads: 4
  params_dtype: bf16
  activation_func: silu
  attention_backend: FLASH
optimizer: {lr: 1e-3}
dataset:
  seq_length: 32
  split: 99,1,0
tokenizer: {tokenizer_type: NullTokenizer, vocab_size: 256}
logger: {wandb_exp_name: 2024-01-01}
"""
    )
    cfg = ConfigContainer.from_yaml(path)
    assert type(cfg.dataset) is GPTDatasetConfig and cfg.dataset.sequence_length == 32
    assert cfg.dataset.split == "99,1,0"
    assert cfg.dataset.is_explicit("sequence_length")
    assert cfg.optimizer.lr == 1e-3
    assert cfg.model.params_dtype is torch.bfloat16
    assert cfg.model.activation_func is torch.nn.functional.silu
    assert cfg.model.attention_backend is AttnBackend.flash
    assert cfg.logger.wandb_exp_name == "2024-01-01"  # not a date object


# ---------------------------------------------------------------------- allowlist
def test_target_outside_the_allowlist_is_refused_with_a_fix(tmp_path):
    data = to_dict(make_config())
    data["model"]["init_method"] = {"_target_": "os.system", "_partial_": True, "_args_": ["echo hi"]}
    with pytest.raises(ConfigValidationError) as info:
        from_dict(data, ConfigContainer)
    message = str(info.value)
    assert "model.init_method: 'os.system' is not a name configs may use" in message
    assert "register yours in code with megatron_bridge.config.targets.register_target(obj)" in message


@pytest.mark.parametrize(
    "name",
    [
        "torch.os.system",
        "torch.serialization.os.system",
        "torch.save",
        "megatron_bridge.config.serialization.register_target",
        "megatron_bridge.config.targets.importlib.import_module",
        "megatron_bridge.__main__.main",
        "megatron_bridge.models.llama.F",
        "builtins.eval",
    ],
)
def test_names_reached_through_allowed_modules_are_refused(name):
    with pytest.raises(targets.TargetNotAllowedError, match="is not a name configs may use"):
        targets.resolve(name)


def test_registered_names_resolve_exactly():
    assert targets.resolve("torch.nn.functional.silu") is torch.nn.functional.silu
    assert targets.resolve("signal.Signals.SIGTERM") is signal.SIGTERM
    assert targets.resolve("megatron_bridge.training.config.TrainingConfig") is TrainingConfig
    assert targets.name_of(TrainingConfig) == "megatron_bridge.training.config.TrainingConfig"
    assert targets.name_of(lambda x: x) is None
    with pytest.raises(targets.TargetNotAllowedError, match="closest: torch.nn.functional.silu"):
        targets.resolve("torch.nn.functional.silux")
    with pytest.raises(targets.TargetNotAllowedError, match="is not a dotted name"):
        targets.resolve("a..b")


def test_functions_are_referenced_or_bound_never_called():
    data = to_dict(make_config())
    data["model"]["init_method"] = {"_target_": "torch.nn.init.normal_", "_args_": [1.0]}
    with pytest.raises(ConfigValidationError, match="is not a config class, and configs do not call functions"):
        from_dict(data, ConfigContainer)
    data["model"]["init_method"] = {
        "_target_": "torch.nn.init.normal_",
        "_partial_": True,
        "std": {"_target_": "torch.nn.functional.silu", "_call_": False},
    }
    with pytest.raises(ConfigValidationError, match="function arguments must be plain data"):
        from_dict(data, ConfigContainer)


@dataclasses.dataclass
class UserData(DatasetProvider):
    """A user dataset: defining the class (code) registers it."""

    path: str = "data.txt"
    seq_length: int = 32

    def build_datasets(self, context):
        return None, None, None


def my_activation(x):
    return torch.tanh(x) * 2


def test_user_classes_and_registered_functions_round_trip(tmp_path):
    cfg = tiny_config(dataset=UserData(path="/d.txt"))
    assert_same_config(cfg, reload(cfg, tmp_path))
    cfg.model.activation_func = my_activation
    assert to_dict(cfg)["model"]["activation_func"] == {"_unserializable_": repr(my_activation)}
    targets.register_target(my_activation)
    assert to_dict(cfg)["model"]["activation_func"] == f"{__name__}.my_activation"
    assert reload(cfg, tmp_path).model.activation_func is my_activation


def test_register_target_needs_a_name_for_objects_without_an_import_path():
    with pytest.raises(ValueError, match="has no import path"):
        targets.register_target(lambda x: x)
    with pytest.raises(ValueError, match="is not a dotted name"):
        targets.register_target(my_activation, name="bad name")


# ---------------------------------------------------------------------- loading errors
def test_unknown_keys_are_errors_naming_the_closest_fields():
    data = to_dict(make_config())
    data["train"]["train_iter"] = 5
    data["modle"] = {}
    with pytest.raises(ConfigValidationError) as info:
        from_dict(data, ConfigContainer)
    errors = info.value.errors
    assert "train.train_iter: unknown key: TrainingConfig has no field 'train_iter' (did you mean 'train_iters'" in errors[0]
    assert errors[1].startswith("modle: unknown key: ConfigContainer has no field 'modle' (did you mean 'model'?)")


def test_all_loading_errors_are_raised_together():
    data = to_dict(make_config())
    data["model"]["num_layers"] = "abc"
    data["model"]["params_dtype"] = "bfloat99"
    data["model"]["attention_backend"] = "flsh"
    data["train"]["exit_signal"] = 3.5
    data["optimizer"]["lr"] = "fast"
    data["model"]["_explicit_"] = ["num_layerz"]
    with pytest.raises(ConfigValidationError) as info:
        from_dict(data, ConfigContainer)
    errors = info.value.errors
    assert len(errors) == 6
    assert "model.num_layers: expected int, got str 'abc' (use a whole number, e.g. 8)" in errors
    assert any(e.startswith("model.params_dtype: expected a torch dtype, got str 'bfloat99'") for e in errors)
    assert any("model.attention_backend: expected AttnBackend" in e and "did you mean 'flash'" in e for e in errors)
    assert any(e.startswith("train.exit_signal: expected Signals") for e in errors)
    assert any(e.startswith("optimizer.lr: expected float, got str 'fast'") for e in errors)
    assert any(e.startswith("model._explicit_: 'num_layerz' is not a field of GPTModelProvider") for e in errors)


def test_missing_required_section_is_an_error():
    data = to_dict(make_config())
    del data["model"]
    with pytest.raises(ConfigValidationError, match="model: is required by ConfigContainer but missing"):
        from_dict(data, ConfigContainer)


def test_target_of_the_wrong_class_is_an_error():
    data = to_dict(make_config())
    data["dataset"]["_target_"] = "megatron_bridge.training.config.TrainingConfig"
    with pytest.raises(
        ConfigValidationError, match="dataset: _target_ 'megatron_bridge.training.config.TrainingConfig' is not a"
    ):
        from_dict(data, ConfigContainer)


def test_target_that_does_not_exist_is_an_error():
    data = to_dict(make_config())
    data["train"]["_target_"] = "megatron_bridge.training.config.NoSuchConfig"
    with pytest.raises(ConfigValidationError, match="'megatron_bridge.training.config.NoSuchConfig' is not a name configs may use"):
        from_dict(data, ConfigContainer)


def test_data_without_target_needs_a_class():
    with pytest.raises(ConfigValidationError, match="no _target_ says which config class this is"):
        from_dict({"train": {}})
    with pytest.raises(ConfigValidationError, match="expected a mapping of sections"):
        from_dict([1, 2], ConfigContainer)


def test_union_section_without_target_takes_the_class_that_knows_its_keys():
    data = to_dict(make_config())
    data["dataset"] = {"seq_length": 32, "dataset_root": "/x", "memmap_workers": 2}
    assert type(from_dict(data, ConfigContainer).dataset) is FinetuningDatasetConfig
    data["dataset"] = {"seq_length": 32, "data_path": "a", "dataset_rot": "/x"}
    with pytest.raises(ConfigValidationError, match="dataset.dataset_rot: unknown key: GPTDatasetConfig has no field 'dataset_rot'"):
        from_dict(data, ConfigContainer)


def test_abstract_section_without_target_is_an_error():
    with pytest.raises(ConfigValidationError, match="cannot tell which DatasetProvider this is"):
        from_dict({"num_workers": 1}, DatasetProvider)


def test_unserializable_values_are_written_as_placeholders_and_refused_on_load(tmp_path):
    cfg = make_config()
    cfg.model.activation_func = lambda x: x  # no import path can name a lambda
    text = cfg.to_yaml(tmp_path / "cfg.yaml")
    assert "_unserializable_: <function" in text
    with pytest.raises(
        ConfigValidationError, match="model.activation_func: the saved value <function .* had no YAML form"
    ):
        ConfigContainer.from_yaml(tmp_path / "cfg.yaml")


class _Optimizer:
    def scale_loss(self, loss):
        return loss


def test_runtime_hooks_the_framework_installed_load_as_defaults(tmp_path):
    # What pretrain() leaves on the model config when a checkpoint writes run_config.yaml.
    cfg = make_config()
    cfg.model.apply_default("grad_scale_func", _Optimizer().scale_loss)
    text = cfg.to_yaml(tmp_path / "cfg.yaml")
    assert "grad_scale_func:\n    _unserializable_: <bound method" in text
    loaded = ConfigContainer.from_yaml(tmp_path / "cfg.yaml")
    assert loaded.model.grad_scale_func is None and not loaded.model.is_explicit("grad_scale_func")


def test_every_recipe_round_trips(tmp_path):
    recipes = pytest.importorskip("recipes")
    for name in recipes.list_recipes():
        cfg = recipes.get_recipe(name)()
        assert_same_config(cfg, reload(cfg, tmp_path))


def test_missing_empty_and_invalid_yaml_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        from_yaml(tmp_path / "nope.yaml", ConfigContainer)
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigValidationError, match="empty.yaml is empty"):
        from_yaml(tmp_path / "empty.yaml", ConfigContainer)
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    with pytest.raises(ConfigValidationError, match="bad.yaml, line 2: invalid YAML"):
        from_yaml(tmp_path / "bad.yaml", ConfigContainer)


@pytest.mark.parametrize(
    "text, message",
    [
        ("train: {train_iters: 5}\noptimizer: {lr: 0.1}\ntrain: {train_iters: 6}\n",
         "line 3: key 'train' is given twice in the same mapping (lines 1 and 3)"),
        ("train:\n  train_iters: 5\n  global_batch_size: 8\n  train_iters: 6\n",
         "line 4: key 'train_iters' is given twice in the same mapping (lines 2 and 4)"),
        ("env_vars:\n  - {A: 1}\n  - A: 1\n    B: [x, {C: 1, C: 2}]\n",
         "line 4: key 'C' is given twice in the same mapping (lines 4 and 4)"),
        ("env_vars: {A: 1, 'A': 2}\n", "line 1: key 'A' is given twice in the same mapping (lines 1 and 1)"),
    ],
)  # fmt: skip
def test_a_key_given_twice_in_a_yaml_mapping_is_refused(tmp_path, text, message):
    (tmp_path / "dup.yaml").write_text(text)
    with pytest.raises(ConfigValidationError) as err:
        from_yaml(tmp_path / "dup.yaml", ConfigContainer)
    assert f"dup.yaml, {message}; only one value can count (keep one of them)" in str(err.value)


def test_the_same_key_in_different_mappings_and_repeated_merge_keys_are_fine():
    from megatron_bridge.config.yaml_input import parse

    text = "a: &x {k: 1}\nb: &y {k: 2}\nc:\n  <<: *x\n  <<: *y\n  k: 3\nd: [{k: 1}, {k: 2}]\nk: {k: {k: 4}}\n"
    assert parse(text) == {"a": {"k": 1}, "b": {"k": 2}, "c": {"k": 3}, "d": [{"k": 1}, {"k": 2}], "k": {"k": {"k": 4}}}


@pytest.mark.parametrize(
    "text",
    [
        "a: &x {k: [1, 2.5, null, true, yes, 1e-4, 0x10, '007', 2024-01-01]}\nb: *x\nc: &s 3\nd: [*s, *x]\n",
        "a: &x {k: 1}\nb: &y {k: 2}\nc:\n  <<: [*x, *y]\n  j: 3\n",  # merge keys: yaml.load builds it
        "a: !!str 5\nb: !!float '1'\nc: ! 12\nd: !!set {x, y}\ne: !!binary aGk=\n",  # explicit tags
        "? [a, b]\n: unhashable\n",
        "a: 1\n---\nb: 2\n",
        "a: &x 1\nb: &x 2\n",
        "&a [&a [1], *a]\n",  # an anchor repeated inside itself
        "a: *nowhere\n",
        "",
        "--- |\n  text\n",
    ],
)  # fmt: skip
def test_yaml_reader_builds_what_the_safe_loader_builds(text):
    from megatron_bridge.config.yaml_input import YamlLoader, parse

    try:
        expected = yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError as exc:
        with pytest.raises(ConfigValidationError, match="invalid YAML") as err:
            parse(text)
        assert str(exc.problem) in str(err.value)
        return
    data = parse(text)
    assert data == expected and type(data) is type(expected)
    if text.startswith("a: &x {k: ["):  # an alias is the anchored object itself
        assert data["b"] is data["a"] and data["d"][1] is data["a"]


def test_override_values_type_keys_and_tagged_scalars_as_before():
    from megatron_bridge.config.overrides import parse_value

    assert parse_value("{1e3: !!str 0x1, true: ! 12, a:b:c}") == {"1e3": "0x1", "true": 12, "a": "b:c"}
    assert parse_value("[!!str 1, !!int '2', 1e3, {k:v, 'q:1': }]") == ["1", 2, 1000.0, {"k": "v", "q:1": ""}]


def test_yaml_is_read_with_a_safe_loader(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("train: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigValidationError, match="invalid YAML"):
        from_yaml(path, ConfigContainer)


def test_mixed_precision_section_and_string_both_round_trip(tmp_path):
    cfg = make_config()
    assert reload(cfg, tmp_path).mixed_precision == "bf16_mixed"
    cfg.mixed_precision = MixedPrecisionConfig(bf16=True, params_dtype=torch.bfloat16)
    assert_same_config(cfg, reload(cfg, tmp_path))
    cfg = tiny_config(dataset=MockGPTDatasetConfig(seq_length=32))
    assert_same_config(cfg, reload(cfg, tmp_path))


REFERENCE_YAML = """\
_target_: megatron.bridge.training.config.ConfigContainer
train:
  _target_: megatron.bridge.training.config.TrainingConfig
  train_iters: 20
  global_batch_size: 8
  micro_batch_size: 2
  exit_signal: {_target_: signal.Signals, _call_: true, _args_: [15]}
model:
  _target_: megatron.bridge.models.llama.llama_provider.Llama3ModelProvider8B
  num_layers: 2
  params_dtype: {_target_: torch.bfloat16, _call_: false}
  activation_func: {_target_: torch.nn.functional.silu, _call_: false}
  transformer_layer_spec: {_target_: megatron.bridge.models.gpt_provider.default_layer_spec, _call_: false}
optimizer: {_target_: megatron.bridge.training.config.OptimizerConfig, lr: 0.001}
dataset: {_target_: megatron.bridge.training.config.MockGPTDatasetConfig, sequence_length: 32}
comm_overlap: {_target_: megatron.bridge.training.comm_overlap.CommOverlapConfig, tp_comm_overlap: false}
"""


def test_yaml_written_by_the_reference_system_loads(tmp_path):
    from megatron_bridge.models import Llama3ModelProvider8B
    from megatron_bridge.training.comm_overlap import CommOverlapConfig

    path = tmp_path / "reference.yaml"
    path.write_text(REFERENCE_YAML)
    cfg = ConfigContainer.from_yaml(path)
    assert cfg.train.exit_signal is signal.SIGTERM and type(cfg.model) is Llama3ModelProvider8B
    assert cfg.model.params_dtype is torch.bfloat16 and cfg.model.activation_func is torch.nn.functional.silu
    assert cfg.model.transformer_layer_spec is None and cfg.model.num_layers == 2
    assert type(cfg.comm_overlap) is CommOverlapConfig and cfg.dataset.sequence_length == 32
    path.write_text(REFERENCE_YAML.replace("[15]", "[99]").replace("llama_provider.Llama3", "llama_provider.Llama9"))
    with pytest.raises(ConfigValidationError) as err:
        ConfigContainer.from_yaml(path)
    assert "train.exit_signal: 99 is not a value of signal.Signals" in str(err.value)
    assert "model: _target_: 'megatron.bridge.models.llama.llama_provider.Llama9ModelProvider8B' is not a name" in str(err.value)
