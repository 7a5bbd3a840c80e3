"""Files from elsewhere given to the command line, each case in a fresh process: a checkpoint whose
pickled files (`.metadata`, `common.pt`) were altered to run code is refused before anything
loads it, by every command that reads checkpoints; JSON nested past the parser's recursion limit
is reported as malformed; prompts are not read from a device (/dev/zero never ends); a run name is one directory under --dir; a text prompt for a model without a tokenizer
is reported, not a traceback; a dry run does not print a value read from the environment;
environment values that are not numbers, and an index whose arrays lie, are reported by name.

One tiny checkpoint is trained first; the cases then start together (a few processes at a time)
and each test checks its own.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import shutil
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
from factories import started
from text_data import train_tokenizer, write_jsonl

from megatron_bridge.data.indexed import IndexedDatasetWriter, write_index

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "tiny_gpt_pretrain_config"
SECRET = "s3cr3t-Path-from-the-environment"
PARALLEL = 3


class _Touch:
    """Unpickled, creates the file `path`: what a tampered checkpoint could do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(extra)
    return env


def _mbridge(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`mbridge argv` in a fresh process; a leading command prefix (`setpriv ... --`) runs it."""
    prefix = argv[: argv.index("--") + 1] if argv and argv[0] == "setpriv" else []
    return subprocess.run(
        [*prefix, sys.executable, "-m", "megatron_bridge", *argv[len(prefix) :]], cwd=REPO, env=env or _env(),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def _tampered(runs: str, name: str, file: str, marker: str) -> str:
    """A copy of the trained run `runs/tiny_gpt_pretrain` as `runs/name`, its `file` replaced by a
    pickle that creates `marker`; returns the copy's checkpoint directory."""
    source = os.path.join(runs, "tiny_gpt_pretrain")
    shutil.copytree(source, os.path.join(runs, name))
    checkpoints = os.path.join(runs, name, "checkpoints")
    (iteration,) = [d for d in os.listdir(checkpoints) if d.startswith("iter_")]
    with open(os.path.join(checkpoints, iteration, file), "wb") as f:
        pickle.dump(_Touch(marker), f)
    return checkpoints


def _truncated(runs: str, name: str, file: str) -> str:
    """A copy of the trained run `runs/tiny_gpt_pretrain` as `runs/name`, its `file` cut to 50
    bytes (a damaged copy); returns the copy's checkpoint directory."""
    source = os.path.join(runs, "tiny_gpt_pretrain")
    shutil.copytree(source, os.path.join(runs, name))
    checkpoints = os.path.join(runs, name, "checkpoints")
    (iteration,) = [d for d in os.listdir(checkpoints) if d.startswith("iter_")]
    os.truncate(os.path.join(checkpoints, iteration, file), 50)
    return checkpoints


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile")


@pytest.fixture(scope="module")
def cases(work) -> Mapping[str, tuple[Future, str]]:
    """name -> (future of its CompletedProcess, marker file a tampered checkpoint would create), each
    started at once (under pytest-xdist when first asked for: `factories.started`)."""
    runs = os.path.join(str(work), "runs")
    trained = _mbridge(["pretrain", "--recipe", TINY, "--dir", runs, "train.train_iters=1", "validation.eval_iters=0"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    clean = os.path.join(runs, "tiny_gpt_pretrain", "checkpoints")
    mark = {n: os.path.join(str(work), f"ran-{n}") for n in ("generate", "resume", "export")}
    meta = _tampered(runs, "meta", ".metadata", mark["generate"])
    common = _tampered(runs, "common", "common.pt", mark["resume"])
    export = _tampered(runs, "export", ".metadata", mark["export"])
    cut = _truncated(runs, "cut", "common.pt")
    deep = "[" * 100_000 + "]" * 100_000  # past Python's recursion limit
    hf_dir = os.path.join(str(work), "hf-deep")
    os.makedirs(hf_dir)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"], "nested": ' + deep + "}")
    with open(os.path.join(hf_dir, "model.safetensors"), "wb") as f:
        f.write(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    prompts = os.path.join(str(work), "prompts.jsonl")
    with open(prompts, "w") as f:
        f.write('{"prompt": "1 2"}\n{"prompt": ' + deep + "}\n")
    config = os.path.join(str(work), "small.yaml")
    with open(config, "w") as f:
        f.write("train:\n  train_iters: 3\n")
    damaged = os.path.join(str(work), "damaged")
    writer = IndexedDatasetWriter(damaged, np.uint16)
    writer.add_document(np.arange(10), [10])
    writer.add_document(np.arange(10), [10])
    writer.finalize()
    write_index(damaged + ".idx", np.uint16, np.array([-10, 30], dtype=np.int32), np.arange(3))
    latin1 = os.path.join(str(work), "latin1.jsonl")
    with open(latin1, "wb") as f:
        f.write(b'{"prompt": "1 2"}\n{"prompt": "caf\xe9"}\n')
    argvs = {
        "generate": (["generate", meta, "--prompt", "1 2 3", "--max-new-tokens", "1"], None),
        "resume": (["pretrain", "--recipe", TINY, "--dir", runs, "--name", "common", "train.train_iters=2"], None),
        "export": (["hf", "export", export, os.path.join(str(work), "hf-out")], None),
        "cut common generate": (["generate", cut, "--prompt", "1 2 3", "--max-new-tokens", "1"], None),
        "cut common resume": (["pretrain", "--recipe", TINY, "--dir", runs, "--name", "cut", "train.train_iters=2"], None),
        "cut common export": (["hf", "export", cut, os.path.join(str(work), "hf-cut")], None),
        "step not saved": (["generate", clean, "--prompt", "1 2", "--step", "7"], None),
        "step of an iteration directory": (["eval", os.path.join(clean, "iter_0000001"), "--data", prompts, "--step", "7"], None),
        "deep config.json": (["hf", "import", hf_dir, os.path.join(str(work), "imported")], None),
        "deep prompts": (["generate", clean, "--prompts", prompts, "--max-new-tokens", "1"], None),
        "endless prompts": (["generate", clean, "--prompts", os.devnull.replace("null", "zero")], None),
        "escaping name": (["pretrain", "--recipe", TINY, "--dir", runs, "--name", "../escaped", "--dry-run"], None),
        "text prompt": (["generate", clean, "--prompt", "hello world", "--max-new-tokens", "1"], None),
        "secret path": (["pretrain", "--recipe", TINY, "--dry-run", "--recipe-arg", "tokenizer=${oc.env:MB_TEST_TOKENIZER}"],
                        _env(MB_TEST_TOKENIZER=SECRET)),
        "config size limit": (["pretrain", "--recipe", TINY, "--config", config, "--dry-run"], _env(MBRIDGE_MAX_CONFIG_BYTES="8 MiB")),
        "launcher rank": (["pretrain", "--recipe", TINY, "--dir", runs, "--name", "rank", "train.train_iters=1"], _env(LOCAL_RANK="first")),
        "launcher world": (["hf", "export", clean, os.path.join(str(work), "hf-world")], _env(WORLD_SIZE="two")),
        "damaged index": (["data", "inspect", damaged], None),
        "latin-1 prompts": (["generate", clean, "--prompts", latin1, "--max-new-tokens", "1"], None),
        **_output_cases(str(work), clean),
    }  # fmt: skip
    pool = ThreadPoolExecutor(PARALLEL)
    yield started(argvs, lambda name: (pool.submit(_mbridge, *argvs[name]), mark.get(name)))
    pool.shutdown(wait=False)


_NO_ROOT_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
"""A command prefix under which root, like any user, cannot write into a directory without write
permission (the capability that lets root ignore permissions is dropped)."""


def _read_only_prefix() -> list[str] | None:
    """What makes a read-only directory read-only for the command: nothing for a user, setpriv
    for root; None where root cannot drop the capability (the read-only cases are then skipped)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") and subprocess.run([*_NO_ROOT_OVERRIDE, "true"]).returncode == 0:
        return _NO_ROOT_OVERRIDE
    return None


def _output_cases(work: str, checkpoint: str) -> dict[str, tuple[list[str], None]]:
    """Commands writing into a read-only directory, under a file, or where a name is too long."""
    read_only, a_file = os.path.join(work, "read-only"), os.path.join(work, "a-file")
    os.makedirs(read_only)
    os.chmod(read_only, 0o555)
    with open(a_file, "w") as f:
        f.write("x\n")
    tokenizer = train_tokenizer(os.path.join(work, "tok"), texts=["some text to tokenize"] * 4)
    corpus = os.path.join(work, "corpus.jsonl")
    write_jsonl(corpus, [{"text": "some text"}, {"text": "to tokenize"}])
    slurm = ["slurm", "--recipe", TINY, "--nodes", "1", "--gpus-per-node", "1", "--cpu"]
    cases = {
        "export under a file": (["hf", "export", checkpoint, os.path.join(a_file, "hf")], None),
        "export name without room for its staging suffix": (["hf", "export", checkpoint, os.path.join(work, "e" * 250)], None),
        "slurm script into a directory": ([*slurm, "-o", work], None),
        "slurm logs under a file": ([*slurm, "-o", os.path.join(work, "job.sbatch"), "--log-dir", os.path.join(a_file, "logs")], None),
    }
    prefix = _read_only_prefix()
    if prefix is not None:
        preprocess = ["data", "preprocess", "--input", corpus, "--tokenizer", tokenizer, "--output-prefix"]
        cases.update({
            "export into read-only": ([*prefix, "hf", "export", checkpoint, os.path.join(read_only, "hf")], None),
            "preprocess into read-only": ([*prefix, *preprocess, os.path.join(read_only, "corpus")], None),
            "slurm script into read-only": ([*prefix, *slurm, "-o", os.path.join(read_only, "job.sbatch")], None),
        })  # fmt: skip
    return cases


def _refused(cases, name: str) -> str:
    future, marker = cases[name]
    result = future.result()
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if marker is not None:
        assert not os.path.exists(marker), "code in the tampered checkpoint ran"
    return result.stderr


@pytest.mark.timeout(400)
def test_generate_refuses_tampered_metadata(cases):
    err = _refused(cases, "generate")
    assert ".metadata is not loaded: it names pathlib.Path.touch" in err, err
    assert "source you trust" in err


@pytest.mark.timeout(400)
def test_resume_refuses_tampered_common_state(cases):
    err = _refused(cases, "resume")
    assert "checkpoint.load:" in err and "common.pt is not loaded" in err, err
    assert "could run code from the file" in err


@pytest.mark.timeout(400)
def test_hf_export_refuses_tampered_metadata(cases):
    err = _refused(cases, "export")
    assert ".metadata is not loaded: it names pathlib.Path.touch" in err, err


@pytest.mark.timeout(400)
def test_a_damaged_common_state_is_one_message_in_every_command(cases):
    """A `common.pt` cut short: generate refuses it before building the model (it said the weights
    did not fit the model), resume and hf export with exit status 2 (they ended in torch's
    traceback)."""
    damaged = "common.pt cannot be read (PytorchStreamReader failed reading zip archive: failed finding central directory)"
    fix = "(the checkpoint is damaged or incomplete: load another one, or save it again)"
    generate = _refused(cases, "cut common generate")
    assert "the checkpoint" in generate and "cannot be used: " in generate and damaged in generate and fix in generate, generate
    assert "do not fit its model" not in generate
    resume = _refused(cases, "cut common resume")
    assert "checkpoint.load:" in resume and damaged in resume and fix in resume, resume
    export = _refused(cases, "cut common export")
    assert damaged in export and fix in export, export


@pytest.mark.timeout(400)
def test_a_step_that_names_no_saved_iteration_is_named_by_its_flag(cases):
    """`--step 7` where no iteration 7 was saved named the config field (`ckpt_step=7`), and an
    `iter_N` directory was loaded whatever `--step` said."""
    missing = _refused(cases, "step not saved")
    assert "--step 7: " in missing and "holds no checkpoint of iteration 7 (complete iterations: [1]; give one of " \
        "them, or leave --step out for the latest)" in missing and "ckpt_step" not in missing, missing  # fmt: skip
    other = _refused(cases, "step of an iteration directory")
    assert "--step 7: " in other and "iter_0000001' is the checkpoint of iteration 1 (leave --step out, or give the " \
        "directory that holds its iterations)" in other, other  # fmt: skip


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_json_nested_past_the_recursion_limit(cases):
    err = _refused(cases, "deep config.json")
    assert "config.json is not valid JSON (arrays or objects nested too deeply" in err, err
    err = _refused(cases, "deep prompts")
    assert "prompts.jsonl:2: not JSON (arrays or objects nested too deeply)" in err, err
    err = _refused(cases, "latin-1 prompts")
    assert "latin1.jsonl:2: not JSON (not UTF-8 text (byte 0xe9))" in err, err


@pytest.mark.timeout(400)
def test_prompts_from_a_device_are_refused(cases):
    err = _refused(cases, "endless prompts")
    assert "--prompts '/dev/zero' is a character device, not a file of prompts" in err, err


@pytest.mark.timeout(400)
def test_run_name_that_leaves_the_output_directory(cases):
    err = _refused(cases, "escaping name")
    assert "name: '../escaped' is not a run name: the outputs go to dir/name" in err, err


@pytest.mark.timeout(400)
def test_text_prompt_without_tokenizer(cases):
    err = _refused(cases, "text prompt")
    assert "prompt 1: 'hello' is not a token id" in err and "from 0 to 255" in err, err


@pytest.mark.timeout(400)
def test_dry_run_data_lines_hide_environment_values(cases):
    result = cases["secret path"][0].result()
    assert result.returncode == 0, result.stderr[-3000:]
    assert SECRET not in result.stdout + result.stderr
    assert "tokenizer.tokenizer_model: '${oc.env:MB_TEST_TOKENIZER}': not found" in result.stdout, result.stdout[-2000:]


@pytest.mark.timeout(400)
def test_environment_values_that_are_not_numbers(cases):
    err = _refused(cases, "config size limit")
    assert "MBRIDGE_MAX_CONFIG_BYTES: '8 MiB' is not a positive whole number of bytes (set it to a size in bytes" in err, err
    err = _refused(cases, "launcher rank")
    assert "LOCAL_RANK: 'first' is not a whole number of at least 0 (launchers such as torchrun set it" in err, err
    err = _refused(cases, "launcher world")
    assert "WORLD_SIZE: 'two' is not a whole number of at least 1" in err, err


@pytest.mark.timeout(400)
def test_data_inspect_of_a_damaged_index(cases):
    err = _refused(cases, "damaged index")
    assert "damaged.idx gives sequence 0 a negative length (-10)" in err, err


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_outputs_under_a_file_or_with_too_long_names_are_refused_before_any_work(cases):
    err = _refused(cases, "export under a file")
    assert "a-file/hf.incomplete lies under" in err and "a-file, which is a file, not a directory (give a directory" in err, err
    err = _refused(cases, "export name without room for its staging suffix")
    assert f"{'e' * 250}.incomplete: the name {'e' * 40!r}... is 261 bytes, over the 255 bytes" in err, err
    err = _refused(cases, "slurm script into a directory")
    assert "--output: cannot write the script to" in err and "Is a directory" in err, err
    err = _refused(cases, "slurm logs under a file")
    assert "--log-dir:" in err and "which is a file, not a directory" in err, err


@pytest.mark.timeout(400)
def test_outputs_into_a_read_only_directory_are_refused_before_any_work(cases):
    if "export into read-only" not in cases:
        pytest.skip("root here cannot drop the capability that overrides permissions (setpriv)")
    err = _refused(cases, "export into read-only")
    assert "read-only is not writable by this user (give a directory this user can write, with names the filesystem can store, for an export)" in err, err
    err = _refused(cases, "preprocess into read-only")
    assert "--output-prefix:" in err and "read-only cannot be written: Permission denied" in err, err
    err = _refused(cases, "slurm script into read-only")
    assert "--output: cannot write the script to" in err and "Permission denied" in err, err
