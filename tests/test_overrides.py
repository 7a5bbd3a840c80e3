"""`process_config_with_overrides`: YAML file then CLI overrides in Hydra's grammar, typed
values, interpolation, and every error a user can cause."""

import os
import signal

import pytest
import torch
from factories import tiny_config
from megatron.core.transformer.enums import AttnBackend

from megatron_bridge.training.config import (
    ConfigValidationError,
    FaultToleranceConfig,
    GPTDatasetConfig,
    runtime_config_update,
)
from megatron_bridge.config.serialization import to_yaml
from megatron_bridge.training.mixed_precision import MixedPrecisionConfig
from megatron_bridge.config.overrides import process_config_with_overrides
from megatron_bridge.config.overrides import parse_value


def make_config():
    return tiny_config(mixed_precision="bf16_mixed")


def apply(*overrides, cfg=None, path=None):
    cfg = make_config() if cfg is None else cfg
    out = process_config_with_overrides(cfg, config_filepath=path, cli_overrides=list(overrides))
    assert out is cfg
    return cfg


def errors_of(*overrides, cfg=None, path=None):
    with pytest.raises(ConfigValidationError) as info:
        apply(*overrides, cfg=cfg, path=path)
    return info.value.errors


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------- values by declared type
def test_scalars_are_typed_and_count_as_explicit():
    cfg = apply("train.train_iters=5", "optimizer.lr=1e-4", "train.manual_gc=true", "checkpoint.save=/tmp/x")
    assert cfg.train.train_iters == 5 and cfg.optimizer.lr == 1e-4 and cfg.train.manual_gc is True
    assert cfg.checkpoint.save == "/tmp/x"
    assert cfg.train.is_explicit("manual_gc") and cfg.checkpoint.is_explicit("save")


def test_value_equal_to_the_default_still_counts_as_explicit():
    cfg = apply("model.bf16=false")
    assert cfg.model.is_explicit("bf16")


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "torch.bfloat16", "BF16"])
def test_dtype_spellings(spelling):
    assert apply(f"model.params_dtype={spelling}").model.params_dtype is torch.bfloat16


@pytest.mark.parametrize(
    "spelling, dtype",
    [
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("half", torch.float16),
        ("fp32", torch.float32),
        ("float32", torch.float32),
    ],
)
def test_more_dtype_spellings(spelling, dtype):
    assert apply(f"optimizer.main_grads_dtype={spelling}").optimizer.main_grads_dtype is dtype


def test_callables_by_short_name_or_import_path():
    assert apply("model.activation_func=silu").model.activation_func is torch.nn.functional.silu
    assert apply("model.activation_func=squared_relu").model.activation_func.__module__ == "megatron.core.activations"
    cfg = apply("model.activation_func=torch.nn.functional.gelu")
    assert cfg.model.activation_func is torch.nn.functional.gelu


def test_enums_by_name_and_literals():
    cfg = apply("model.attention_backend=flash", "train.exit_signal=sigint", "logger.timing_log_level=2")
    assert cfg.model.attention_backend is AttnBackend.flash
    assert cfg.train.exit_signal is signal.SIGINT
    assert cfg.logger.timing_log_level == 2


def test_quoted_values_stay_strings_and_null_is_none():
    cfg = apply("logger.wandb_exp_name='2024'", "dataset.split=99,1,0", "logger.tensorboard_dir=null")
    assert cfg.logger.wandb_exp_name == "2024"
    assert cfg.dataset.split == "99,1,0"
    assert cfg.logger.tensorboard_dir is None


def test_numbers_are_accepted_for_string_fields():
    assert apply("logger.wandb_exp_name=2024").logger.wandb_exp_name == "2024"


def test_hydra_scalar_grammar():
    assert parse_value("1e-4") == 1e-4 and parse_value("10") == 10 and parse_value("-.inf") == float("-inf")
    assert parse_value("True") is True and parse_value("null") is None and parse_value("") == ""
    assert parse_value("[1, 'a,b', [x]]") == [1, "a,b", ["x"]]
    assert parse_value("{A: 1, 'b c': [2]}") == {"A": 1, "b c": [2]}
    assert parse_value("${model.seq_length}") == "${model.seq_length}"


def test_values_are_read_by_the_config_file_reader():
    # YAML flow syntax, Hydra's scalars: only true/false are booleans, integers are decimal
    assert parse_value("[yes, on, 0x10, 1:30, 007, 1_000, inf]") == ["yes", "on", "0x10", "1:30", 7, 1000, float("inf")]
    assert parse_value("yes") == "yes" and parse_value("a: b, c") == "a: b, c" and parse_value("tRUE") is True
    assert parse_value("{A:1, b: {c:x}, 2: [ ]}") == {"A": 1, "b": {"c": "x"}, "2": []}  # keys are strings
    assert parse_value("""['it''s', "tab\\tend"]""") == ["it's", "tab\tend"]  # YAML's quoting rules
    assert parse_value("[${a.b}, x${oc.select:c,${d}}y, {k: '${e}'}]") == ["${a.b}", "x${oc.select:c,${d}}y", {"k": "${e}"}]
    with pytest.raises(ValueError, match="nests deeper than 64 levels"):  # the file reader's limits
        parse_value("[" * 65 + "]" * 65)
    with pytest.raises(ValueError, match="expands to more than"):
        parse_value("[&a [1,1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], "
                    "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], [*e,*e,*e]]")  # fmt: skip


# ---------------------------------------------------------------------- lists and dicts
def test_lists_replace_and_items_change_by_index():
    cfg = apply(
        "dataset.data_path=[a,b]",
        "logger.comet_tags=[x,y,z]",
        "logger.comet_tags.1=w",
        "train.rampup_batch_size=[32,32,1000]",
        "train.rampup_batch_size.0=16",
        "~logger.comet_tags.2",
        cfg=tiny_config(dataset=GPTDatasetConfig(seq_length=32)),
    )
    assert cfg.dataset.data_path == ["a", "b"]
    assert cfg.logger.comet_tags == ["x", "w"]
    assert cfg.train.rampup_batch_size == [16, 32, 1000]
    assert cfg.logger.is_explicit("comet_tags")


def test_list_items_are_typed():
    errors = errors_of("train.rampup_batch_size=[1,2,3]", "train.rampup_batch_size.1=two")
    assert errors[0].startswith("train.rampup_batch_size.1: expected int, got str 'two'")


def test_dicts_add_merge_and_remove_keys():
    cfg = apply(
        "++env_vars={A:1}", "+env_vars.B=x", "env_vars.A=2", "++logger.mlflow_tags.team=llm", "++env_vars={C:3}"
    )
    assert cfg.env_vars == {"A": 2, "B": "x", "C": 3}
    assert cfg.logger.mlflow_tags == {"team": "llm"}
    cfg = apply("~env_vars.B", cfg=cfg)
    assert cfg.env_vars == {"A": 2, "C": 3}
    assert cfg.is_explicit("env_vars")


def test_dict_values_follow_the_declared_item_type():
    assert apply("++logger.mlflow_tags.n=1").logger.mlflow_tags == {"n": "1"}  # dict[str, str]


def test_dict_changes_do_not_leak_into_shared_dicts():
    shared = {"A": 1}
    cfg = make_config()
    cfg.env_vars = shared
    apply("+env_vars.B=2", cfg=cfg)
    assert shared == {"A": 1}


# ---------------------------------------------------------------------- delete (~)
def test_delete_resets_a_field_to_its_default_and_forgets_the_user_set_it():
    cfg = make_config()
    cfg.validation.eval_iters = 7
    apply("~validation.eval_iters", "~train.train_iters", cfg=cfg)
    assert cfg.validation.eval_iters == 100 and not cfg.validation.is_explicit("eval_iters")
    assert cfg.train.train_iters is None and not cfg.train.is_explicit("train_iters")


def test_delete_with_a_value_checks_the_current_value():
    cfg = apply("~train.train_iters=20")
    assert cfg.train.train_iters is None
    assert errors_of("~train.global_batch_size=3")[0].startswith("train.global_batch_size: is 8, not 3")


def test_deleting_a_required_field_is_an_error():
    assert "model: is required and has no default" in errors_of("~model")[0]


def test_deleted_field_takes_the_preset_value_again():
    cfg = make_config()
    cfg.model.params_dtype = torch.float32
    apply("~model.params_dtype", cfg=cfg)
    runtime_config_update(cfg)
    assert cfg.model.params_dtype is torch.bfloat16


# ---------------------------------------------------------------------- sections
def test_keys_inside_a_null_section_create_it():
    cfg = apply("ft.enable_ft_package=false", "ft.simulated_fault_base_delay=3")
    assert isinstance(cfg.ft, FaultToleranceConfig) and cfg.ft.simulated_fault_base_delay == 3


def test_preset_name_can_be_refined_key_by_key():
    cfg = apply("mixed_precision.fp8=hybrid")
    assert isinstance(cfg.mixed_precision, MixedPrecisionConfig)
    assert cfg.mixed_precision.bf16 and cfg.mixed_precision.fp8 == "hybrid"
    assert apply("mixed_precision=fp16_mixed").mixed_precision == "fp16_mixed"


def test_a_mapping_value_merges_into_a_section():
    cfg = apply("train={train_iters: 3, manual_gc: true}")
    assert cfg.train.train_iters == 3 and cfg.train.manual_gc and cfg.train.global_batch_size == 8


def test_aliases_work_in_overrides():
    assert apply("dataset.seq_length=64").dataset.sequence_length == 64


# ---------------------------------------------------------------------- YAML file
def test_yaml_file_then_cli_overrides(tmp_path):
    path = write(tmp_path, "train:\n  train_iters: 7\n  global_batch_size: 16\noptimizer:\n  lr: 1e-3\n")
    cfg = apply("train.train_iters=9", path=path)
    assert cfg.train.train_iters == 9  # CLI wins
    assert cfg.train.global_batch_size == 16 and cfg.optimizer.lr == 1e-3
    assert cfg.optimizer.is_explicit("lr")


def test_interpolation_in_yaml_and_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("MB_TEST_SAVE_DIR", "/ckpt")
    path = write(
        tmp_path,
        "model:\n  seq_length: 64\n"
        "dataset:\n  seq_length: ${model.seq_length}\n"
        "checkpoint:\n  save: ${oc.env:MB_TEST_SAVE_DIR}/run\n  load: ${checkpoint.save}\n",
    )
    cfg = apply(
        "model.seq_length=128",
        "logger.tensorboard_dir=${checkpoint.save}/tb",
        "train.train_iters=${validation.eval_interval}",
        path=path,
    )
    assert cfg.dataset.sequence_length == 128  # resolved after the CLI changed model.seq_length
    assert cfg.checkpoint.save == "/ckpt/run" and cfg.checkpoint.load == "/ckpt/run"
    assert cfg.logger.tensorboard_dir == "/ckpt/run/tb"
    assert cfg.train.train_iters == 10  # from the config itself


def test_unresolvable_interpolation_is_an_error():
    errors = errors_of("train.train_iters=${nope.value}")
    assert len(errors) == 1 and errors[0].startswith("train.train_iters: cannot resolve '${nope.value}'")


def test_an_unset_environment_variable_names_the_variable_to_set(monkeypatch):
    monkeypatch.delenv("MB_TEST_UNSET_VAR", raising=False)
    errors = errors_of("checkpoint.save=${oc.env:MB_TEST_UNSET_VAR}/run")
    assert errors == [
        "checkpoint.save: cannot resolve '${oc.env:MB_TEST_UNSET_VAR}/run': KeyError raised while resolving interpolation: "
        "\"Environment variable 'MB_TEST_UNSET_VAR' not found\" [override 'checkpoint.save=${oc.env:MB_TEST_UNSET_VAR}/run'] "
        "(set MB_TEST_UNSET_VAR in the environment, or give a default: ${oc.env:MB_TEST_UNSET_VAR,DEFAULT})"
    ]


def test_interpolations_in_a_yaml_list_resolve_and_fail_as_the_whole_list(tmp_path):
    cfg = apply(path=write(tmp_path, "logger:\n  wandb_project: proj\n  comet_tags: [a, '${logger.wandb_project}']\n"))
    assert cfg.logger.comet_tags == ["a", "proj"]
    # one problem for the list, as for the same list given as an override (no placeholder left in it)
    errors = errors_of(path=write(tmp_path, "logger:\n  comet_tags: [a, '${nope.x}']\n"))
    assert len(errors) == 1 and errors[0].startswith("logger.comet_tags: cannot resolve ['a', '${nope.x}']")


def test_yaml_section_with_another_target_replaces_the_section(tmp_path):
    path = write(
        tmp_path,
        "dataset:\n"
        "  _target_: megatron_bridge.training.config.GPTDatasetConfig\n"
        "  data_path: [a, b]\n"
        "  seq_length: 32\n",
    )
    cfg = apply(path=path)
    assert type(cfg.dataset) is GPTDatasetConfig and cfg.dataset.data_path == ["a", "b"]
    assert cfg.dataset.num_workers == 2  # a new section: defaults, not the old section's values


def test_yaml_section_with_a_disallowed_target_is_refused(tmp_path):
    path = write(tmp_path, "dataset:\n  _target_: collections.OrderedDict\n")
    errors = errors_of(path=path)
    assert errors[0].startswith("dataset: _target_: 'collections.OrderedDict' is not a name configs may use")
    assert "register_target(obj)" in errors[0]


def test_a_saved_config_used_as_config_file_reproduces_it(tmp_path):
    saved = make_config()
    saved.train.train_iters = 99
    saved.model.bf16 = False  # explicit and equal to the default
    path = tmp_path / "saved.yaml"
    to_yaml(saved, path)
    cfg = apply(path=path)
    assert cfg == saved
    assert cfg.model.explicit_fields() == saved.model.explicit_fields()
    assert not cfg.model.is_explicit("params_dtype")


def test_a_saved_runtime_config_used_as_config_file_still_validates(tmp_path):
    saved = make_config()
    runtime_config_update(saved)
    path = tmp_path / "saved.yaml"
    to_yaml(saved, path)
    cfg = apply("model.hidden_size=128", path=path)
    runtime_config_update(cfg)
    assert cfg.model.ffn_hidden_size == 4 * 128  # derived again, not the saved 256


def test_missing_config_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        apply(path=tmp_path / "nope.yaml")


def test_invalid_yaml_and_non_mapping_files(tmp_path):
    assert "invalid YAML" in errors_of(path=write(tmp_path, "train: [1,\n"))[0]
    assert "not a mapping of sections" in errors_of(path=write(tmp_path, "- 1\n- 2\n", "list.yaml"))[0]


def test_unknown_key_in_yaml_file_names_close_keys(tmp_path):
    path = write(tmp_path, "train:\n  train_iter: 5\n")
    errors = errors_of(path=path)
    assert errors[0].startswith("train.train_iter: unknown key: TrainingConfig has no field 'train_iter' [file ")
    assert "did you mean 'train_iters'" in errors[0]


def test_empty_config_file_changes_nothing(tmp_path):
    assert apply(path=write(tmp_path, "")) == make_config()


# ---------------------------------------------------------------------- errors
def test_wrong_type_is_an_error():
    errors = errors_of("train.train_iters=abc")
    assert errors == [
        "train.train_iters: expected int, got str 'abc' [override 'train.train_iters=abc'] (use a whole number, e.g. 8)"
    ]


def test_unknown_key_names_the_closest_keys():
    errors = errors_of("train.train_iter=3")
    assert errors[0].startswith("train.train_iter: unknown key: TrainingConfig has no field 'train_iter'")
    assert "did you mean 'train_iters'" in errors[0]
    assert "did you mean 'model'" in errors_of("modle.num_layers=2")[0]


def test_add_on_a_dataclass_is_an_unknown_key_error():
    assert "cannot add key 'foo': TrainingConfig has a fixed set of fields" in errors_of("+train.foo=1")[0]
    assert "already exists, so it cannot be added" in errors_of("+train.train_iters=1")[0]
    assert errors_of("++train.train_iter=1")[0].startswith("train.train_iter: unknown key: TrainingConfig has no field")


def test_dict_key_errors():
    assert "env_vars has no key 'A'" in errors_of("env_vars.A=1")[0]  # '=' changes, '+' adds
    assert "use +env_vars.A=1 to add it" in errors_of("env_vars.A=1")[0]
    assert "already exists" in errors_of("++env_vars={A:1}", "+env_vars.A=2")[0]
    assert "env_vars has no key 'A' to remove" in errors_of("~env_vars.A")[0]


def test_list_index_errors():
    cfg = make_config()
    cfg.logger.comet_tags = ["a"]
    assert "index 3 is out of range for a list of 1" in errors_of("logger.comet_tags.3=x", cfg=cfg)[0]
    assert "'x' is not an index" in errors_of("logger.comet_tags.x=1", cfg=cfg)[0]
    assert "logger.comet_tags is null, so it has no key '0'" in errors_of("logger.comet_tags.0=x")[0]


def test_bad_values_for_special_types():
    errors = errors_of("model.params_dtype=bfloat99", "model.activation_func=silly", "model.attention_backend=flsh")
    assert errors[0].startswith("model.params_dtype: expected a torch dtype, got str 'bfloat99'")
    assert "no function 'silly' in torch.nn.functional or megatron.core.activations" in errors[1]
    assert "did you mean 'flash'" in errors[2]


def test_import_paths_outside_the_allowlist_are_refused():
    errors = errors_of("model.activation_func=os.system")
    assert "'os.system' is not a name configs may use" in errors[0] and "register_target(obj)" in errors[0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.train_iters", "has no '='"),
        ("=5", "has an empty key"),
        ("train..x=1", "is not a dotted key"),
        ("train.rampup_batch_size=[1,2", "expected ',' or ']'"),
        ("logger.wandb_project='abc", "unterminated quote"),
    ],
)
def test_malformed_overrides(override, message):
    errors = errors_of(override)
    assert len(errors) == 1 and message in errors[0]


def test_all_errors_are_reported_together():
    errors = errors_of(
        "train.train_iters=abc", "noequals", "modle.x=1", "optimizer.lr=fast", "train.micro_batch_size=2"
    )
    assert [e.split(":")[0] for e in errors] == ["noequals", "train.train_iters", "modle", "optimizer.lr"]
    assert "override 'noequals' has no '='" in errors[0]


def test_an_override_that_is_not_a_string_and_a_long_one_are_named_as_in_their_source_tag():
    errors = errors_of(5, "train." + "x" * 100)
    assert errors[0] == "5: override 5 is not a string [override '5'] (pass strings like 'train.train_iters=100')"
    shown = "'train." + "x" * 70 + "..."  # the override as its source tag shows it, cut at 80 characters
    assert f"override {shown} has no '=' [override {shown}]" in errors[1]


def test_file_and_override_errors_are_reported_together(tmp_path):
    path = write(tmp_path, "train:\n  train_iters: many\n")
    errors = errors_of("optimizer.lr=fast", path=path)
    assert errors[0].startswith("train.train_iters: expected int, got str 'many' [file ")
    assert errors[1].startswith("optimizer.lr: expected float, got str 'fast' [override 'optimizer.lr=fast']")


def test_refining_an_unknown_preset_is_an_error():
    errors = errors_of("mixed_precision=bf17", "mixed_precision.fp8=hybrid")
    assert len(errors) == 1
    assert errors[0].startswith("mixed_precision: unknown preset 'bf17' [override 'mixed_precision.fp8=hybrid']")
    assert "use one of: bf16_mixed" in errors[0]


def test_does_not_finalize_or_touch_the_environment():
    cfg = apply("model.hidden_size=128", "++env_vars={MB_TEST_NOT_APPLIED: 1}")
    assert cfg.model.ffn_hidden_size is None and cfg.data_parallel_size is None
    assert cfg.mixed_precision == "bf16_mixed"
    assert "MB_TEST_NOT_APPLIED" not in os.environ


def test_relative_and_item_interpolations(tmp_path):
    path = write(tmp_path, "checkpoint:\n  save: /ckpt\n  load: ${.save}\n")
    cfg = make_config()
    cfg.logger.comet_tags = ["first", "second"]
    apply(
        "logger.wandb_exp_name=${logger.comet_tags.1}",
        "logger.wandb_project=${oc.select:nope.x,proj}",
        cfg=cfg,
        path=path,
    )
    assert cfg.checkpoint.load == "/ckpt"
    assert cfg.logger.wandb_exp_name == "second" and cfg.logger.wandb_project == "proj"


@pytest.mark.timeout(60)
def test_interpolations_that_double_at_each_step_are_refused_before_resolving(tmp_path):
    # each key refers twice to the one before: resolving the last would take 2**40 steps
    chain = "".join(f"x{i}: ${{x{i - 1}}}${{x{i - 1}}}\n" for i in range(1, 41))
    errors = errors_of(path=write(tmp_path, "x0: abc\n" + chain))
    assert len(errors) == 1 and errors[0].startswith("x11: interpolations expand to more than 4096 references"), errors
    assert "[file " in errors[0] and "refer to each value once" in errors[0]
    # the same through overrides, by length: 90k characters tripled five times
    errors = errors_of("+env_vars.V0=" + "a" * 90_000, *(f"+env_vars.V{i}=" + f"${{env_vars.V{i - 1}}}" * 3 for i in range(1, 6)))
    assert len(errors) == 1 and errors[0].startswith("env_vars.V5: interpolations expand to more than"), errors
    assert "16,000,000 characters" in errors[0] and "[override '+env_vars.V5=" in errors[0]
    # a value used many times, and a chain used once at each step, resolve
    cfg = apply("logger.wandb_project=p", *(f"+env_vars.V{i}=${{logger.wandb_project}}/{i}" for i in range(200)),
                "logger.wandb_exp_name=${env_vars.V199}-${env_vars.V0}")  # fmt: skip
    assert cfg.env_vars["V7"] == "p/7" and cfg.logger.wandb_exp_name == "p/199-p/0"
    # beside a large value, resolvers around an interpolation count only what they refer to
    # (and a reference nested in a resolver's argument finds the config's field: it was "not found")
    decoded = "".join(f"  {k}: \"${{oc.decode:'${{train.train_iters}}'}}\"\n" for k in ("A", "B", "C"))
    cfg = apply(path=write(tmp_path, "logger:\n  wandb_project: " + "x" * 7_000_000 + "\nenv_vars:\n" + decoded))
    assert cfg.env_vars == {"A": 20, "B": 20, "C": 20}, cfg.env_vars


def test_a_saved_run_with_runtime_hooks_used_as_config_file(tmp_path):
    saved = make_config()
    saved.model.apply_default("no_sync_func", lambda: None)  # a hook a training run installs
    path = tmp_path / "run_config.yaml"
    to_yaml(saved, path)
    cfg = apply(path=path)
    assert cfg.model.no_sync_func is None and not cfg.model.is_explicit("no_sync_func")


def test_overrides_given_as_one_string_instead_of_a_list_are_refused():
    cfg = tiny_config()
    with pytest.raises(TypeError) as err:
        process_config_with_overrides(cfg, cli_overrides="train.train_iters=5")
    assert str(err.value) == (
        "cli_overrides must be a list of override strings, got the str 'train.train_iters=5'; "
        "pass ['train.train_iters=5']"
    )
    assert cfg.train.train_iters == 20
    process_config_with_overrides(cfg, cli_overrides=("train.train_iters=5",))  # any sequence of strings
    assert cfg.train.train_iters == 5
