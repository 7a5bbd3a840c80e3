"""The README runs as written: every fenced block is extracted and run (commands on CPU, in a
temporary directory), run as a dry run where it needs GPUs or real data, or skipped with a
reason. The only edits are the ones listed in `PLAN` (temporary directories, fewer iterations).
A block without an entry in `PLAN`, or an entry without a block, fails the test."""

from __future__ import annotations

import concurrent.futures
import os
import re
import stat
import subprocess
import sys

import pytest

from factories import missing_packages, source_tree_env
from text_data import documents, train_tokenizer, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")

FEWER = "fewer iterations"
TMP = "temporary directory"

# (text the block starts with, action, edits [(old, new, why)], reason)
#   run: a command block run as written (after the edits); output: a `$ command` block whose
#   command runs and whose shown lines appear in its output; dry-run: run with --dry-run added
#   (GPUs or real data); python: written to its `# file.py` and run; file: written to its
#   `# name` (used by later blocks); skip: not runnable, with the reason.
PLAN = [
    ("bash tools/bootstrap.sh &&", "run",
     [("bash tools/bootstrap.sh && .venv/bin/mbridge", "mbridge", "the environment is already set up (bootstrap installs from the network)"),
      ("tiny_gpt_pretrain_config", "tiny_gpt_pretrain_config train.train_iters=20", FEWER)], ""),
    ("bash tools/bootstrap.sh dev", "skip", [], "runs the whole test suite, this test included"),
    ("mbridge pretrain --recipe llama3_8b_pretrain_config --dry-run", "run", [], ""),
    ("torchrun --nproc_per_node=8", "dry-run",
     [("torchrun --nproc_per_node=8 -m megatron_bridge", "mbridge", "8 GPUs"), ("/results", "{tmp}/results", TMP)], ""),
    ("$ mbridge pretrain --recipe llama3_8b_pretrain_config --plan-only", "output", [], ""),
    ("$ mbridge pretrain --recipe llama3_70b_pretrain_config --plan-only", "output", [], ""),
    ("# on each of the 2 nodes", "dry-run",
     [("torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=node0:29500 --rdzv-id=run1 \\\n    -m megatron_bridge",
       "mbridge", "2 nodes of 8 GPUs"), ("/shared/results", "{tmp}/shared", TMP),
      ("llama3_8b_pretrain_config", "llama3_8b_pretrain_config --world-size 16", "the size torchrun would give")], ""),
    ("mbridge slurm", "run", [("sbatch llama3_70b_pretrain.sbatch", "test -s llama3_70b_pretrain.sbatch", "no Slurm here: the script is checked instead"),
                              ("/lustre/runs", "{tmp}/lustre", TMP)], ""),
    ("# my.yaml", "file", [], ""),
    ("mbridge pretrain --recipe tiny_gpt_pretrain_config --name overrides --config-file my.yaml", "run",
     [("train.train_iters=50", "train.train_iters=5", FEWER)], ""),
    ("$ mbridge pretrain --recipe tiny_gpt_pretrain_config train.train_iter=5", "output", [], ""),
    ("# train.py", "python", [("train_iters=50", "train_iters=5", FEWER)], ""),
    ("from megatron_bridge.models import Llama3ModelProvider8B", "python", [], ""),
    ("from megatron_bridge.models import GPTModelProvider", "python", [], ""),
    ("# my_data.py", "python", [("train_iters=30", "train_iters=5", FEWER)], ""),
    ("# groups.py", "python", [("train_iters=30", "train_iters=5", FEWER)], ""),
    ("mbridge data preprocess", "run", [("model.vocab_size=512", "model.vocab_size=512 train.train_iters=3", FEWER)], ""),
    ("dataset:\n  data_path:", "skip", [], "a fragment of a config (blend phases are run in tests/test_phases.py)"),
    ('{"input": "What is', "skip", [], "sample rows in text; the tiny recipes read token ids (data/sft below)"),
    ('{"messages":', "skip", [], "sample rows in text; chat data is run in tests/test_chat_sft.py"),
    ("mbridge finetune --recipe tiny_gpt_lora_finetune_config", "run",
     [("dataset_root=data/sft\n", "dataset_root=data/sft train.train_iters=4\n", FEWER),
      ("peft.dim=8 --name tiny_gpt_dora", "peft.dim=8 --name tiny_gpt_dora train.train_iters=4", FEWER)], ""),
    ("mbridge peft export runs/llama3_8b", "skip", [], "needs a fine-tuned Llama-style model (tests/test_peft.py exports adapters of a tiny one)"),
    ("mbridge generate runs/corpus/checkpoints", "run", [], ""),
    ("mbridge hf import /models/Meta-Llama-3-8B", "skip", [], "needs a Hugging Face model (the same commands run on a tiny one in tests/test_hf_finetune.py)"),
    ("WANDB_MODE=offline mbridge pretrain", "run", [("--name trackers", "--name trackers train.train_iters=10", FEWER)], ""),
    ("mbridge plot", "run", [], ""),
    ("megatron_bridge/config/ ", "skip", [], "the source layout, not a command"),
]


# Blocks that need optional packages (trackers, plotting): where one is not installed, the block
# is not run and the test, once every other block has passed, is reported as skipped with the names.
NEEDS = {
    "WANDB_MODE=offline mbridge pretrain": ("wandb", "mlflow", "comet_ml"),
    "mbridge plot": ("matplotlib", "mlflow"),  # it plots the runs of the block above
}


# Blocks that read nothing the other blocks write and write nothing they read (besides dry runs
# and printed plans): they run in the second lane too.
SIDE_LANE = (
    "mbridge pretrain --recipe llama3_8b_pretrain_config --dry-run",
    "mbridge slurm",
    "from megatron_bridge.models import Llama3ModelProvider8B",
    "from megatron_bridge.models import GPTModelProvider",
    "# my_data.py",
    "# groups.py",
)


def readme_blocks() -> list[str]:
    with open(README) as f:
        return [body for _, body in re.findall(r"^```(\w*)\n(.*?)^```", f.read(), re.M | re.S)]


def plan_for(block: str):
    matches = [entry for entry in PLAN if block.startswith(entry[0])]
    assert len(matches) == 1, f"README block has {len(matches)} PLAN entries:\n{block[:300]}"
    return matches[0]


def test_every_readme_block_has_a_plan():
    blocks = readme_blocks()
    used = [plan_for(block)[0] for block in blocks]
    assert sorted(used) == sorted(entry[0] for entry in PLAN), "PLAN entries without a README block"
    assert len(blocks) == len(PLAN) == 27
    for start, action, _, reason in PLAN:
        assert action != "skip" or reason, f"{start!r} skipped without a reason"


def _fixtures(tmp) -> None:
    """Input files the README's commands read (made here: nothing is downloaded)."""
    write_jsonl(os.path.join(tmp, "corpus.jsonl"), [{"text": d} for d in documents(200, seed=3)])
    train_tokenizer(os.path.join(tmp, "tok"), vocab_size=300)
    sft = os.path.join(tmp, "data", "sft")
    os.makedirs(sft)
    rows = [{"input": " ".join(str(5 + (i + j) % 50) for j in range(6)), "output": f"{i % 40 + 1} {i % 30 + 2}"} for i in range(64)]
    write_jsonl(os.path.join(sft, "training.jsonl"), rows)
    write_jsonl(os.path.join(sft, "validation.jsonl"), rows[:16])
    bindir = os.path.join(tmp, "bin")
    os.makedirs(bindir)
    wrapper = os.path.join(bindir, "mbridge")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" -W ignore -m megatron_bridge "$@"\n')
    os.chmod(wrapper, os.stat(wrapper).st_mode | stat.S_IEXEC)


def _edit(block: str, edits, tmp: str) -> str:
    for old, new, _why in edits:
        assert old in block, f"edit {old!r} does not apply"
        block = block.replace(old, new.format(tmp=tmp))
    return block


def _shell(script: str, tmp: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-e", "-c", script], cwd=tmp, env=env, capture_output=True, text=True, timeout=900)


def _check_output(start: str, text: str, tmp: str, env: dict) -> None:
    """Run the `$ command` of an output block; each line it shows must appear in the output."""
    lines = text.splitlines()
    command = []
    for line in lines:
        command.append(line.lstrip("$ ").rstrip("\\").strip() if not command else line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    proc = _shell(" ".join(command), tmp, env)
    shown = [l for l in lines[len(command):] if l.strip() and "..." not in l]
    output = proc.stdout + proc.stderr
    for line in shown:
        assert line.strip() in output, f"{start}: {line!r} not in the output:\n{output[-4000:]}"


def _check_run(start: str, text: str, tmp: str, env: dict) -> None:
    proc = _shell(text, tmp, env)
    assert proc.returncode == 0, f"{start}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _run_python(start: str, name: str, tmp: str, env: dict):
    def run() -> None:
        proc = subprocess.run([sys.executable, "-W", "ignore", name], cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{start}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    return run


def _check_dry_run(start: str, text: str, tmp: str, env: dict) -> None:
    proc = _shell(_dry(text), tmp, env)
    assert proc.returncode == 0, f"{start}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_readme_runs_as_written(tmp_path):
    tmp = str(tmp_path)
    _fixtures(tmp)
    env = source_tree_env(PATH=os.path.join(tmp, "bin") + os.pathsep + os.environ["PATH"])
    ran, not_run = 0, {}
    # Dry runs, printed plans and the SIDE_LANE blocks read nothing the other blocks write and
    # write nothing they read: they run in a second lane beside the blocks that build on each other.
    side_lane = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    side_jobs = []
    for block in readme_blocks():
        start, action, edits, _reason = plan_for(block)
        if action == "skip":
            continue
        missing = missing_packages(*NEEDS.get(start, ()))
        if missing:
            not_run[start] = missing
            continue
        text = _edit(block, edits, tmp)
        if action == "file":
            name = text.splitlines()[0].lstrip("# ").strip()
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        elif action == "python":
            first = text.splitlines()[0]
            name = first.lstrip("# ").strip() if first.startswith("# ") and first.endswith(".py") else f"block_{ran}.py"
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
            run = _run_python(start, name, tmp, env)
            if start in SIDE_LANE:
                side_jobs.append(side_lane.submit(run))
            else:
                run()
        elif action in ("output", "dry-run"):
            check = _check_output if action == "output" else _check_dry_run
            side_jobs.append(side_lane.submit(check, start, text, tmp, env))
        elif start in SIDE_LANE:
            side_jobs.append(side_lane.submit(_check_run, start, text, tmp, env))
        else:
            _check_run(start, text, tmp, env)
        ran += 1
    side_lane.shutdown(wait=True)
    for job in side_jobs:
        job.result()  # raises the block's assertion
    assert ran + len(not_run) == sum(1 for entry in PLAN if entry[1] != "skip")
    assert all(any(start == entry[0] for entry in PLAN) for start in (*SIDE_LANE, *NEEDS))
    if not_run:
        pytest.skip(f"{ran} blocks ran as written; not run for missing optional packages: {not_run}")


def _dry(text: str) -> str:
    """Each mbridge command with --dry-run after its subcommand."""
    return re.sub(r"\bmbridge (pretrain|finetune)\b", r"mbridge \1 --dry-run", text)
