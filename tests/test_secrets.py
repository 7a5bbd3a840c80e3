"""Secrets stay out of what a config is written to: values read from the environment go back as
`${oc.env:VAR}`, credential-named fields as `<redacted>`, in saved configs, tracker records,
printed configs, log lines and error messages; and a real run with every tracker leaves no byte of
a secret in its directory."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import zipfile

import pytest
from factories import needs, source_tree_env, tiny_config

from megatron_bridge.config import secrets
from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.config.overrides import process_config_with_overrides
from megatron_bridge.training.config import ConfigContainer, runtime_config_update

SECRET = "Zq-token-4f1d9c2b7e-from-the-environment"
LITERAL = "literal-credential-8a7b6c"


@pytest.mark.parametrize(
    "name, credential",
    [
        ("comet_api_key", True), ("HF_TOKEN", True), ("WANDB_API_KEY", True), ("AWS_SECRET_ACCESS_KEY", True),
        ("DB_PASSWORD", True), ("githubToken", True), ("client_secret_file", True), ("KEY", True),
        ("pad_token", False), ("eos_token", False), ("special_tokens", False), ("linear_key_head_dim", False),
        ("tokenizer_model", False), ("moe_token_dispatcher_type", False), ("NCCL_ALGO", False), (3, False),
    ],
)  # fmt: skip
def test_which_names_mark_credentials(name, credential):
    assert secrets.is_credential_name(name) is credential


def test_environment_values_are_written_back_as_their_interpolation_and_read_again(tmp_path, monkeypatch):
    monkeypatch.setenv("MB_TEST_SECRET", SECRET)
    cfg = tiny_config()
    process_config_with_overrides(cfg, None, [
        "+env_vars.API_TOKEN=${oc.env:MB_TEST_SECRET}", "logger.comet_api_key=${oc.env:MB_TEST_SECRET}",
        "logger.wandb_exp_name=run-${oc.env:MB_TEST_SECRET}", "++env_vars.DB_PASSWORD=" + LITERAL,
        "++env_vars.PLAIN=visible",
    ])  # fmt: skip
    assert cfg.env_vars["API_TOKEN"] == SECRET and cfg.logger.wandb_exp_name == "run-" + SECRET  # the run gets the value
    text = cfg.to_yaml(tmp_path / "cfg.yaml")
    assert SECRET not in text and LITERAL not in text
    assert "API_TOKEN: ${oc.env:MB_TEST_SECRET}" in text and "comet_api_key: ${oc.env:MB_TEST_SECRET}" in text
    assert "wandb_exp_name: run-${oc.env:MB_TEST_SECRET}" in text
    assert "DB_PASSWORD: <redacted>" in text and "PLAIN: visible" in text
    assert SECRET not in str(cfg.to_dict())

    loaded = ConfigContainer.from_yaml(tmp_path / "cfg.yaml")  # resolved in this environment again
    assert loaded.env_vars["API_TOKEN"] == SECRET and loaded.logger.comet_api_key == SECRET
    assert loaded.logger.wandb_exp_name == "run-" + SECRET
    with pytest.raises(ConfigValidationError) as err:  # the redacted credential must be given again
        runtime_config_update(loaded)
    assert "env_vars.DB_PASSWORD: is '<redacted>': the config was written without this credential" in str(err.value)

    monkeypatch.delenv("MB_TEST_SECRET")
    with pytest.raises(ConfigValidationError) as err:
        ConfigContainer.from_yaml(tmp_path / "cfg.yaml")
    assert "env_vars.API_TOKEN: cannot resolve '${oc.env:MB_TEST_SECRET}'" in str(err.value)


def test_a_variable_since_unset_no_longer_rewrites_later_configs(tmp_path, monkeypatch):
    """A long-lived process (a notebook, a test session) reads `/ckpt` from the environment once;
    configs written after the variable is gone must keep their own `/ckpt` text and load again."""
    monkeypatch.setenv("MB_TEST_SUFFIX", "/ckpt")
    process_config_with_overrides(tiny_config(), None, ["checkpoint.save=${oc.env:MB_TEST_SUFFIX}/run"])
    cfg = tiny_config()
    cfg.checkpoint.save = str(tmp_path / "a" / "ckpt")
    assert "${oc.env:MB_TEST_SUFFIX}" in cfg.to_dict()["checkpoint"]["save"]  # same environment: resolves back
    monkeypatch.delenv("MB_TEST_SUFFIX")
    assert cfg.to_dict()["checkpoint"]["save"] == str(tmp_path / "a" / "ckpt")
    cfg.to_yaml(tmp_path / "cfg.yaml")
    assert ConfigContainer.from_yaml(tmp_path / "cfg.yaml").checkpoint.save == str(tmp_path / "a" / "ckpt")


def test_normal_values_round_trip_unchanged(tmp_path):
    cfg = tiny_config()
    cfg.env_vars = {"NCCL_DEBUG": "WARN", "N": 3}
    cfg.logger.wandb_exp_name = "keys-and-tokens"  # credential words inside a value are just text
    text = cfg.to_yaml(tmp_path / "cfg.yaml")
    assert "<redacted>" not in text
    assert ConfigContainer.from_yaml(tmp_path / "cfg.yaml") == cfg


def test_logs_errors_and_urls_do_not_repeat_secrets(monkeypatch, caplog):
    monkeypatch.setenv("MB_TEST_SECRET", SECRET)
    monkeypatch.setenv("MB_TEST_TAKEN", "already-set")
    cfg = tiny_config()
    process_config_with_overrides(cfg, None, ["+env_vars.MB_TEST_TAKEN=${oc.env:MB_TEST_SECRET}"])
    cfg.logger.comet_api_key = LITERAL
    with caplog.at_level(logging.INFO):
        runtime_config_update(cfg)  # the environment's value wins, and the log says so
        cfg.log_non_default_values()
    assert "env_vars.MB_TEST_TAKEN='${oc.env:MB_TEST_SECRET}' not applied" in caplog.text
    assert "comet_api_key=<redacted>" in caplog.text
    assert SECRET not in caplog.text and LITERAL not in caplog.text

    with pytest.raises(ConfigValidationError) as err:
        process_config_with_overrides(tiny_config(), None, ["train.train_iters=${oc.env:MB_TEST_SECRET}"])
    assert SECRET not in str(err.value) and "${oc.env:MB_TEST_SECRET}" in str(err.value)

    cfg = tiny_config()
    cfg.logger.mlflow_tracking_uri = "https://alice:pa55word@mlflow.example.com/api"
    assert cfg.to_dict()["logger"]["mlflow_tracking_uri"] == "https://alice:<redacted>@mlflow.example.com/api"


def test_a_recorded_command_line_hides_credentials_given_as_overrides(monkeypatch):
    monkeypatch.setenv("MB_TEST_SECRET", SECRET)
    process_config_with_overrides(tiny_config(), None, ["+env_vars.A=${oc.env:MB_TEST_SECRET}"])
    argv = ["pretrain", "++env_vars.DB_PASSWORD=" + LITERAL, "logger.comet_api_key=${oc.env:K}",
            "++env_vars={HF_TOKEN: " + LITERAL + ", A: 1}", "++env_vars={A: 1}", "--recipe-arg", "hf_token=" + LITERAL,
            "logger.wandb_exp_name=" + SECRET, "train.train_iters=3"]  # fmt: skip
    assert secrets.conceal_argv(argv) == [
        "pretrain", "++env_vars.DB_PASSWORD=<redacted>", "logger.comet_api_key=${oc.env:K}", "++env_vars=<redacted>",
        "++env_vars={A: 1}", "--recipe-arg", "hf_token=<redacted>", "logger.wandb_exp_name=${oc.env:MB_TEST_SECRET}",
        "train.train_iters=3",
    ]  # fmt: skip


# ---------------------------------------------------------------------- a real run
def _files_holding(root: str, secret: bytes) -> list[str]:
    """Every file under `root` whose bytes hold `secret`, also inside zip archives (Comet's
    offline experiments), with the member as `archive!member`."""

    def in_zip(data: bytes, label: str) -> list[str]:
        try:
            archive = zipfile.ZipFile(io.BytesIO(data))
        except zipfile.BadZipFile:
            return []
        found = []
        for member in archive.namelist():
            inner = archive.read(member)
            found += [f"{label}!{member}"] * (secret in inner) + in_zip(inner, f"{label}!{member}")
        return found

    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as fh:
                data = fh.read()
            found += [path] * (secret in data) + in_zip(data, path)
    return found


def test_the_file_search_finds_a_secret_in_a_file_and_in_a_zip_member(tmp_path):
    (tmp_path / "plain.txt").write_bytes(b"x" + SECRET.encode())
    with zipfile.ZipFile(tmp_path / "a.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("messages.json", "{" + SECRET + "}")
    assert sorted(_files_holding(str(tmp_path), SECRET.encode())) == [f"{tmp_path}/a.zip!messages.json", f"{tmp_path}/plain.txt"]


@pytest.mark.slow  # several fresh processes
@pytest.mark.timeout(600)
def test_a_run_with_every_tracker_leaves_no_secret_in_its_directory(tmp_path):
    needs("mlflow", "wandb", "comet_ml")
    run = tmp_path / "run"
    env = source_tree_env(
        MB_TEST_SECRET=SECRET, HOME=str(tmp_path), WANDB_MODE="offline", WANDB_DIR=str(run / "wandb"),
        WANDB_CACHE_DIR=str(run / "wandb-cache"), WANDB_CONFIG_DIR=str(run / "wandb-config"),
        WANDB_DATA_DIR=str(run / "wandb-data"), MLFLOW_DISABLE_TELEMETRY="true", COMET_ERROR_TRACKING_ENABLE="false",
    )  # fmt: skip
    env.pop("COMET_API_KEY", None)
    (tmp_path / "extra.yaml").write_text("env_vars:\n  FROM_FILE: ${oc.env:MB_TEST_SECRET}\n")
    argv = [
        "pretrain", "--recipe", "tiny_gpt_pretrain_config", "--dir", str(run), "--name", "t",
        "--config-file", str(tmp_path / "extra.yaml"),
        "train.train_iters=4", "checkpoint.save_interval=2", "logger.log_interval=2", "validation.eval_interval=2",
        "validation.eval_iters=1",
        "+env_vars.API_TOKEN=${oc.env:MB_TEST_SECRET}", "logger.comet_api_key=${oc.env:MB_TEST_SECRET}",
        "++env_vars.DB_PASSWORD=" + LITERAL, f"logger.save_config_filepath={run}/config.yaml",
        "logger.wandb_project=p", f"logger.wandb_save_dir={run}/wandb",
        "logger.mlflow_experiment=e", "logger.mlflow_run_name=m", f"logger.mlflow_tracking_uri=sqlite:///{run}/mlflow.db",
        "logger.comet_project=c", "logger.comet_experiment_name=x", f"logger.comet_offline_directory={run}/comet",
        "logger.tracker_subprocess=false",  # the same records; no helper process to start (nor to starve at idle priority)
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bridge", *argv], cwd=str(tmp_path), env=env, capture_output=True, text=True,
        timeout=560,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    written = {os.path.relpath(os.path.join(d, n), run) for d, _, names in os.walk(run) for n in names}
    assert "t/checkpoints/iter_0000004/run_config.yaml" in written and "config.yaml" in written
    assert any(n.startswith("t/tb_logs/events") for n in written) and any(n.startswith("comet/") for n in written)
    assert "mlflow.db" in written and any(n.startswith("wandb/") for n in written)
    run_config = (run / "t/checkpoints/iter_0000004/run_config.yaml").read_text()
    assert "API_TOKEN: ${oc.env:MB_TEST_SECRET}" in run_config and "DB_PASSWORD: <redacted>" in run_config
    assert "FROM_FILE: ${oc.env:MB_TEST_SECRET}" in run_config
    for secret in (SECRET, LITERAL):
        assert _files_holding(str(run), secret.encode()) == [], secret
        assert secret not in proc.stdout + proc.stderr
