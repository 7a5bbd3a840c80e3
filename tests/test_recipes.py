"""The recipe library: every recipe builds offline and validates at the world size it is laid out
for; the registry; recipe options; the tiny CPU recipe's settings."""

from __future__ import annotations

import os
import re
import socket

import pytest
import torch

import recipes
from megatron_bridge.models import count_parameters
from megatron_bridge.training.config import (
    ConfigContainer,
    ConfigValidationError,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    MockGPTDatasetConfig,
    runtime_config_update,
)
from megatron_bridge.training.mixed_precision import bf16_mixed

REQUIRED = {
    "tiny_gpt_pretrain_config",
    "tiny_gpt_finetune_config",
    "llama2_7b_pretrain_config",
    "llama3_8b_pretrain_config",
    "llama3_70b_pretrain_config",
    "llama31_405b_pretrain_config",
    "llama3_8b_finetune_config",
    "mistral_7b_pretrain_config",
    "mixtral_8x7b_pretrain_config",
    "qwen25_7b_pretrain_config",
    "qwen3_8b_pretrain_config",
    "qwen3_30b_a3b_pretrain_config",
}
GPU_RECIPES = sorted(n for n in recipes.list_recipes() if not n.startswith("tiny_"))


@pytest.fixture
def offline(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access while building a recipe: socket{args}")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def build(recipe_name: str, tmp_path, **kwargs) -> ConfigContainer:
    """Build recipe `recipe_name` writing under tmp_path; fine-tuning recipes get an existing
    pretrained-checkpoint directory and dataset root."""
    if recipe_name.endswith("_finetune_config"):
        (tmp_path / "pretrained").mkdir(exist_ok=True)
        kwargs = dict(pretrained_checkpoint=tmp_path / "pretrained", dataset_root=tmp_path, **kwargs)
    return recipes.get_recipe(recipe_name)(dir=tmp_path, **kwargs)


# ---------------------------------------------------------------------- every recipe
@pytest.mark.parametrize("name", recipes.list_recipes())
def test_recipe_builds_offline_and_validates_at_its_world_size(name, tmp_path, offline):
    fn = recipes.get_recipe(name)
    cfg = build(name, tmp_path)
    assert isinstance(cfg, ConfigContainer)
    runtime_config_update(cfg, world_size=fn.world_size)
    m = cfg.model
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    assert cfg.data_parallel_size == fn.world_size // model_parallel
    assert cfg.train.global_batch_size % (cfg.train.micro_batch_size * cfg.data_parallel_size) == 0
    assert cfg.dataset.seq_length == m.seq_length or isinstance(cfg.dataset, FinetuningDatasetConfig)


@pytest.mark.parametrize("name", recipes.list_recipes())
def test_recipe_outputs_go_under_dir_and_name(name, tmp_path):
    cfg = build(name, tmp_path, name="exp1")
    assert cfg.checkpoint.save == os.path.join(tmp_path, "exp1", "checkpoints") == cfg.checkpoint.load
    assert cfg.logger.tensorboard_dir == os.path.join(tmp_path, "exp1", "tb_logs")
    default = build(name, tmp_path)
    assert default.checkpoint.save == os.path.join(tmp_path, name[: -len("_config")], "checkpoints")


def test_dir_none_is_the_default_runs_directory():
    # the reference system's recipes take dir=None for their default output directory
    cfg = recipes.get_recipe("tiny_gpt_pretrain_config")(dir=None)
    assert cfg.checkpoint.save == os.path.join("runs", "tiny_gpt_pretrain", "checkpoints")


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipes_train_in_bf16_through_the_preset(name, tmp_path):
    fn = recipes.get_recipe(name)
    cfg = build(name, tmp_path)
    for section in (cfg.model, cfg.optimizer, cfg.ddp):
        assert not section.explicit_fields() & {"bf16", "fp16", "params_dtype", "pipeline_dtype", "grad_reduce_in_fp32"}
    assert cfg.mixed_precision == "bf16_mixed"
    runtime_config_update(cfg, world_size=fn.world_size)
    assert cfg.model.bf16 and cfg.optimizer.bf16 and cfg.model.params_dtype == torch.bfloat16
    assert cfg.ddp.use_distributed_optimizer and cfg.optimizer.use_distributed_optimizer
    # adapters wrap megatron-core's local linear layers; a model without input norms (OLMo 2) is
    # built on them too (TransformerEngine fuses those norms into its linear layers), as are the
    # families whose provider chooses them (Gemma)
    local = cfg.peft is not None or not cfg.model.input_layernorms or type(cfg.model)().transformer_impl == "local"
    assert cfg.model.transformer_impl == ("local" if local else "transformer_engine")


def test_registry_lists_every_recipe_sorted():
    names = recipes.list_recipes()
    assert names == sorted(names)
    assert REQUIRED <= set(names)
    for name in names:
        fn = recipes.get_recipe(name)
        assert fn.__name__ == name and getattr(recipes, name) is fn
        assert name.endswith(("_pretrain_config", "_finetune_config"))
        assert isinstance(fn.world_size, int) and fn.world_size >= 1
        first_line = fn.__doc__.strip().splitlines()[0]
        assert 20 < len(first_line) <= 100 and first_line.endswith(".")


def test_get_recipe_accepts_the_name_without_suffix():
    assert recipes.get_recipe("llama3_8b_pretrain") is recipes.llama3_8b_pretrain_config


def test_unknown_recipe_names_the_closest_ones():
    with pytest.raises(KeyError) as err:
        recipes.get_recipe("llama3_8b_pretrian_config")
    assert isinstance(err.value, ValueError)
    assert "unknown recipe 'llama3_8b_pretrian_config'; did you mean llama3_8b_pretrain_config" in str(err.value)


def test_unrelated_recipe_name_lists_all_recipes():
    listed = re.escape(", ".join(recipes.list_recipes()))
    with pytest.raises(ValueError, match=f"unknown recipe 'gpt5'; available: {listed} "):
        recipes.get_recipe("gpt5")


def test_unknown_option_suggests_the_closest():
    expected = "got an unknown option 'tensor_parallel_size'; did you mean 'tensor_model_parallel_size'"
    with pytest.raises(TypeError, match=expected):
        recipes.llama3_8b_pretrain_config(tensor_parallel_size=2)


def test_option_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match=r"llama3_8b_pretrain_config\(\): PretrainOptions.train_iters: expected int"):
        recipes.llama3_8b_pretrain_config(train_iters="100")


def test_finetune_options_are_not_pretrain_options():
    with pytest.raises(TypeError, match="unknown option 'dataset_root'"):
        recipes.tiny_gpt_pretrain_config(dataset_root="/data")


def test_recipe_decorator_rejects_bad_declarations():
    from recipes._base import recipe

    with pytest.raises(ValueError, match="must end in _pretrain_config or _finetune_config"):
        recipe(world_size=1)(lambda opts: None)
    with pytest.raises(ValueError, match="recipe world_size must be a positive int, got 0"):
        recipe(world_size=0)

    def my_pretrain_config(opts):
        return None

    with pytest.raises(TypeError, match="my_pretrain_config\\(\\) got an unknown option 'tp'"):
        recipe(world_size=1, tp=2)(my_pretrain_config)
    with pytest.raises(TypeError, match="PretrainOptions.lr: expected float"):
        recipe(world_size=1, lr="high")(my_pretrain_config)
    assert "my_pretrain_config" not in recipes.list_recipes()


def test_signature_shows_the_recipe_defaults():
    import inspect

    params = inspect.signature(recipes.llama3_70b_pretrain_config).parameters
    assert params["tensor_model_parallel_size"].default == 4
    assert params["virtual_pipeline_model_parallel_size"].default == 5
    assert params["dir"].default == "runs"
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())


# ---------------------------------------------------------------------- options
def test_keyword_arguments_override_the_recipe(tmp_path):
    cfg = recipes.llama3_70b_pretrain_config(
        dir=tmp_path,
        tensor_model_parallel_size=8,
        virtual_pipeline_model_parallel_size=None,
        seq_length=4096,
        train_iters=10,
        lr_warmup_iters=2,
        global_batch_size=64,
        lr=1e-4,
        min_lr=1e-6,
    )
    m = cfg.model
    assert (m.tensor_model_parallel_size, m.virtual_pipeline_model_parallel_size, m.seq_length) == (8, None, 4096)
    assert cfg.dataset.seq_length == 4096 and cfg.train.train_iters == 10
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr) == (1e-4, 1e-6)
    runtime_config_update(cfg, world_size=128)
    assert cfg.data_parallel_size == 2


def test_data_paths_and_tokenizer_path(tmp_path):
    paths = ["0.7", "/data/a", "0.3", "/data/b"]
    cfg = recipes.llama3_8b_pretrain_config(dir=tmp_path, data_paths=paths, tokenizer=tmp_path)
    assert type(cfg.dataset) is GPTDatasetConfig and cfg.dataset.data_path == paths
    assert cfg.tokenizer.tokenizer_type == "HuggingFaceTokenizer" and cfg.tokenizer.tokenizer_model == str(tmp_path)
    runtime_config_update(cfg, world_size=8)
    assert cfg.dataset.blend == (["/data/a", "/data/b"], [0.7, 0.3])


def test_mock_data_and_null_tokenizer_by_default(tmp_path):
    cfg = recipes.qwen3_8b_pretrain_config(dir=tmp_path)
    assert type(cfg.dataset) is MockGPTDatasetConfig
    assert cfg.tokenizer.tokenizer_type == "NullTokenizer" and cfg.tokenizer.vocab_size == 151936


def test_precision_config_object(tmp_path):
    mp = bf16_mixed()
    mp.grad_reduce_in_fp32 = False
    cfg = recipes.mistral_7b_pretrain_config(dir=tmp_path, precision_config=mp)
    runtime_config_update(cfg, world_size=8)
    assert cfg.model.bf16 and cfg.ddp.grad_reduce_in_fp32 is False


def test_an_invalid_user_layout_is_reported(tmp_path):
    cfg = recipes.llama3_8b_pretrain_config(dir=tmp_path, tensor_model_parallel_size=3)
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg, world_size=8)
    expected = "data_parallel_size: world size 8 is not divisible by tensor x pipeline x context parallel = 3 x 1 x 2"
    assert expected in str(err.value)


# ---------------------------------------------------------------------- particular recipes
def test_llama31_405b_splits_126_layers_with_embedding_and_loss(tmp_path):
    cfg = recipes.llama31_405b_pretrain_config(dir=tmp_path)
    m = cfg.model
    assert m.num_layers == 126 and m.account_for_embedding_in_pipeline_split and m.account_for_loss_in_pipeline_split
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size) == (8, 8, 2)
    assert m.rope_scaling and m.seq_length == 8192
    m.account_for_loss_in_pipeline_split = False
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg, world_size=1024)
    assert (
        "model.num_layers: 126 layers + 1 (embedding/loss) do not split evenly over "
        "8 pipeline stages x 8 virtual stages"
        in str(err.value)
    )


def test_moe_recipes_use_expert_parallelism(tmp_path):
    mixtral = recipes.mixtral_8x7b_pretrain_config(dir=tmp_path).model
    assert mixtral.expert_model_parallel_size == 8 and mixtral.moe_token_dispatcher_type == "alltoall"
    qwen = recipes.qwen3_30b_a3b_pretrain_config(dir=tmp_path).model
    layout = (qwen.tensor_model_parallel_size, qwen.pipeline_model_parallel_size, qwen.expert_model_parallel_size)
    assert layout == (4, 2, 4)
    assert qwen.expert_tensor_parallel_size == 1
    assert count_parameters(qwen).active < count_parameters(qwen).total / 8


def test_dense_recipes_leave_expert_parallelism_alone(tmp_path):
    assert not recipes.llama3_8b_pretrain_config(dir=tmp_path).model.is_explicit("expert_model_parallel_size")


def test_tiny_recipe_trains_on_one_cpu_process(tmp_path):
    fn = recipes.tiny_gpt_pretrain_config
    cfg = fn(dir=tmp_path)
    assert fn.world_size == 1
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (3, 96, 4, 64)
    assert m.transformer_impl == "local" and m.use_cpu_initialization
    assert type(cfg.dataset) is MockGPTDatasetConfig and cfg.dataset.num_workers == 0
    assert cfg.tokenizer.tokenizer_type == "NullTokenizer" and cfg.tokenizer.vocab_size == 256
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.train_iters) == (8, 4, 200)
    assert cfg.optimizer.lr == 3e-3 and cfg.scheduler.lr_decay_style == "cosine" and cfg.scheduler.lr_warmup_iters == 10
    assert (cfg.logger.log_interval, cfg.validation.eval_interval, cfg.validation.eval_iters) == (10, 50, 4)
    assert cfg.checkpoint.save_interval == 200 and cfg.comm_overlap is None
    runtime_config_update(cfg, world_size=1)
    assert not m.bf16 and m.params_dtype == torch.float32 and not cfg.ddp.use_distributed_optimizer
    assert count_parameters(m).total < 1_000_000


def test_tiny_save_interval_follows_train_iters(tmp_path):
    assert recipes.tiny_gpt_pretrain_config(dir=tmp_path, train_iters=30).checkpoint.save_interval == 30


def test_finetune_recipes_start_from_the_pretrained_checkpoint(tmp_path):
    cfg = build("tiny_gpt_finetune_config", tmp_path)
    assert type(cfg.dataset) is FinetuningDatasetConfig and cfg.dataset.dataset_root == str(tmp_path)
    assert cfg.checkpoint.pretrained_checkpoint == str(tmp_path / "pretrained")
    assert cfg.optimizer.lr < recipes.tiny_gpt_pretrain_config(dir=tmp_path).optimizer.lr
    big = build("llama3_8b_finetune_config", tmp_path)
    assert big.optimizer.lr <= 1e-5 and big.checkpoint.pretrained_checkpoint == str(tmp_path / "pretrained")


def test_finetune_without_data_says_what_to_set(tmp_path):
    cfg = recipes.tiny_gpt_finetune_config(dir=tmp_path, pretrained_checkpoint=tmp_path)
    with pytest.raises(ConfigValidationError, match=r"dataset.dataset_root: is not set \(set dataset.dataset_root"):
        runtime_config_update(cfg, world_size=1)


def test_finetune_with_a_missing_checkpoint_is_reported(tmp_path):
    cfg = recipes.tiny_gpt_finetune_config(dir=tmp_path, dataset_root=tmp_path, pretrained_checkpoint=tmp_path / "nope")
    expected = "checkpoint.pretrained_checkpoint: directory .*nope' does not exist"
    with pytest.raises(ConfigValidationError, match=expected):
        runtime_config_update(cfg, world_size=1)


@pytest.mark.timeout(300)
def test_tiny_recipes_pretrain_then_finetune_for_real(tmp_path):
    import json

    from megatron_bridge.training.checkpointing import read_tracker
    from megatron_bridge.training.finetune import finetune
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    pre = recipes.tiny_gpt_pretrain_config(dir=tmp_path, name="pre", train_iters=12, eval_interval=6, eval_iters=1)
    state = pretrain(pre, forward_step)
    ckpt = tmp_path / "pre" / "checkpoints"
    assert state.train_state.step == 12 and read_tracker(str(ckpt)) == 12
    assert any((tmp_path / "pre" / "tb_logs").iterdir())

    data = tmp_path / "jsonl"
    data.mkdir()
    with open(data / "training.jsonl", "w") as f:
        for start in range(0, 200, 7):
            f.write(json.dumps({"input": " ".join(str((start + i) % 255) for i in range(5)), "output": " ".join(str((start + 5 + i) % 255) for i in range(4))}) + "\n")
    ft = recipes.tiny_gpt_finetune_config(dir=tmp_path, name="ft", train_iters=6, lr_warmup_iters=2, eval_iters=0, dataset_root=data, pretrained_checkpoint=ckpt)
    state = finetune(ft, forward_step)
    assert state.train_state.step == 6  # a new step count from the pretrained weights
    assert read_tracker(str(tmp_path / "ft" / "checkpoints")) == 6


def test_recipes_take_the_reference_systems_argument_names():
    llama = recipes.get_recipe("llama3_8b_pretrain_config")
    cfg = llama(tensor_parallelism=2, pipeline_parallelism=2, context_parallelism=1, sequence_parallelism=True)
    m = cfg.model
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size) == (2, 2, 1)
    assert m.sequence_parallel is True
    with pytest.raises(TypeError) as err:
        llama(tensor_parallelism=2, tensor_model_parallel_size=4)
    assert str(err.value) == (
        "llama3_8b_pretrain_config(): pass either 'tensor_parallelism' or 'tensor_model_parallel_size', not both"
    )


@pytest.mark.parametrize("context, expected", [(131072, 4096), (512, 512)])
def test_a_hugging_face_base_with_a_long_context_fine_tunes_at_4096_tokens_unless_told(tmp_path, caplog, context, expected):
    """The tiny recipes name no length: a Hugging Face base's context (131,072 for Llama 3.1)
    would make every packed micro batch that long."""
    from hf_models import family_configs, save_tiny

    config = family_configs()["llama"]
    config.max_position_embeddings = context
    source = save_tiny("llama", str(tmp_path / "hf"), config=config)
    with caplog.at_level("INFO"):
        cfg = recipes.tiny_gpt_finetune_config(dir=tmp_path, dataset_root=tmp_path, pretrained=source)
    assert cfg.model.seq_length == cfg.dataset.seq_length == expected
    assert (f"seq_length 4096: {source} allows 131072 positions" in caplog.text) == (context > 4096)
    told = recipes.tiny_gpt_finetune_config(dir=tmp_path, dataset_root=tmp_path, pretrained=source, seq_length=8192)
    assert told.model.seq_length == told.dataset.seq_length == 8192
