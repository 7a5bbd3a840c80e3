"""`generate()` and `mbridge generate`: greedy tokens equal transformers' for Llama, Qwen3 and
Mixtral (from the Hugging Face directory and from the imported checkpoint), the KV cache equals
recomputing the whole sequence, sampling is seeded per prompt, stop strings and stop tokens end a
generation, chat prompts use the template; user errors are one message."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil

import pytest
import torch
from factories import tiny_model
from inference_models import hf_tokenizer, mbridge, tiny_hf_model, transformers_model
from text_data import CHATML

from megatron_bridge.inference import generate
from megatron_bridge.inference.model import InferenceModel
from megatron_bridge.inference.sampling import Sampling
from megatron_bridge.inference.sources import SourceError, resolve
from megatron_bridge.models.hf.convert import import_hf

pytestmark = pytest.mark.timeout(400)

FAMILIES = ("llama", "qwen3", "mixtral", "gemma3")
PROMPTS = ["The cat sees", "A farmer builds a green house", "Our"]
NEW = 30


@pytest.fixture(scope="module", autouse=True)
def one_process(monkeypatch_module):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch_module.delenv(name, raising=False)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny Hugging Face directories (Llama's tokenizer has a chat template, Qwen3's none)."""
    root = tmp_path_factory.mktemp("hf")
    names = (*FAMILIES, "mistral")
    return {n: tiny_hf_model(n, root / n, chat_template=CHATML if n == "llama" else None) for n in names}


@pytest.fixture(scope="module")
def checkpoints(models, tmp_path_factory):
    """Each family imported into a checkpoint of ours (what `mbridge hf import` writes)."""
    root = tmp_path_factory.mktemp("imported")
    for name in FAMILIES:
        import_hf(models[name], str(root / name))
    return {name: str(root / name) for name in FAMILIES}


def transformers_greedy(directory: str, prompts: list[str], new: int, eos: bool = False) -> list[list[int]]:
    """transformers' greedy tokens for each prompt alone (no padding), stop tokens off unless `eos`."""
    model = transformers_model(directory)
    if not eos:
        model.generation_config.eos_token_id = None
    tok = hf_tokenizer(directory)
    out = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt).ids])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, pad_token_id=0)
        out.append(generated[0, ids.shape[1] :].tolist())
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_equal_transformers_from_hf_and_from_imported_checkpoint(models, checkpoints, name):
    reference = transformers_greedy(models[name], PROMPTS, NEW)
    assert all(len(r) == NEW for r in reference)
    tok = hf_tokenizer(models[name])
    for source in (models[name], checkpoints[name]):
        out = generate(source, PROMPTS, max_new_tokens=NEW, ignore_eos=True)  # the three prompts in one batch
        assert [g.prompt_token_ids for g in out] == [tok.encode(p).ids for p in PROMPTS]
        assert [g.token_ids for g in out] == reference, source
        assert [g.finish_reason for g in out] == ["length"] * 3
        assert [g.text for g in out] == [tok.decode(r) for r in reference]
        assert out.new_tokens == 3 * NEW and out.tokens_per_second > 0


def test_sliding_window_model_equals_transformers(models):
    """Mistral's window (8) is shorter than the sequences: megatron-core masks by window, and
    prompts of different lengths go in separate batches."""
    reference = transformers_greedy(models["mistral"], PROMPTS[:2], 20)
    out = generate(models["mistral"], PROMPTS[:2], max_new_tokens=20, ignore_eos=True)
    assert [g.token_ids for g in out] == reference


# ---------------------------------------------------------------------- the cache, on a random model
@contextlib.contextmanager
def random_model(kind: str):
    """A randomly initialized tiny GPT with a NullTokenizer (prompts are token ids), built in
    this process: `rope` or `learned_absolute` positions with the default attention backend
    (`auto`), or `rope-unfused`, megatron-core's unfused attention named explicitly."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_bridge.models.hf.runtime import build_chunks, model_parallel, prepare
    from megatron_bridge.runtime.tokenizers.tokenizer import NullTokenizer

    options = {"attention_backend": AttnBackend.unfused} if kind.endswith("unfused") else {}
    model = tiny_model(position_embedding_type=kind.split("-")[0], seq_length=48, vocab_size=64, **options)
    with model_parallel() as device, pytest.MonkeyPatch.context() as env:
        for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            env.delenv(name, raising=False)  # megatron-core records a model's backend there, per process
        provider = prepare(model, device, initialize=True, init_method_std=0.5, parallel_output=False)
        (module,) = build_chunks(provider, device)
        yield InferenceModel(module, NullTokenizer(64), vocab_size=64, seq_length=48, stop_ids=frozenset({63}))


def recompute_greedy(model: InferenceModel, prompt: list[int], new: int) -> list[int]:
    """Greedy decoding without a cache: the whole sequence runs again for every token."""
    ids = list(prompt)
    with model.evaluating():
        for _ in range(new):
            tokens = torch.tensor([ids], device=model.device)
            positions = torch.arange(len(ids), device=model.device)[None]
            ids.append(int(model.logits(tokens, positions, None)[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("kind", ["rope", "learned_absolute", "rope-unfused"])
def test_cached_batched_decoding_equals_recomputing_each_prompt(kind):
    from megatron_bridge.inference.errors import PromptError

    prompts = ["5 9 2", "1 2 3 4 5 6 7 8 9 10 11 12", "40", "7 7 7 7 7 7"]
    with random_model(kind) as model:
        out = generate(model, prompts, max_new_tokens=8, ignore_eos=True)
        for prompt, g in zip(prompts, out):
            assert g.token_ids == recompute_greedy(model, [int(x) for x in prompt.split()], 8), prompt
        # the sequence length bounds a generation: 48 - 12 prompt tokens leave 36
        assert len(generate(model, prompts[1], max_new_tokens=100, ignore_eos=True)[0].token_ids) == 36
        with pytest.raises(PromptError, match="the prompts hold token id 64, beyond the model's vocabulary of 64"):
            generate(model, "5 64")


def test_sampling_is_seeded_per_prompt():
    prompts = ["5 9 2", "1 2 3 4 5 6", "40", "7 7 7"]
    sample = dict(max_new_tokens=10, ignore_eos=True)
    with random_model("rope") as model:
        batched = generate(model, prompts, temperature=1.5, seed=3, **sample)
        alone = generate(model, prompts, temperature=1.5, seed=3, batch_size=1, **sample)
        other = generate(model, prompts, temperature=1.5, seed=4, **sample)
        greedy = generate(model, prompts, **sample)
        top_1 = generate(model, prompts, top_k=1, seed=9, **sample)
    # prompt i draws from its own generator: its sample does not depend on its batch
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]
    assert [g.token_ids for g in other] != [g.token_ids for g in batched] != [g.token_ids for g in greedy]
    assert [g.token_ids for g in top_1] == [g.token_ids for g in greedy]


def test_top_k_and_top_p_sample_from_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    generators = Sampling(top_p=0.75).generators(0, 4000, torch.device("cpu"))
    counts = torch.bincount(Sampling(top_p=0.75).check().choose(logits, generators), minlength=4).tolist()
    assert counts[2] == counts[3] == 0  # 0.5 + 0.3 already holds 0.75
    assert abs(counts[0] / 4000 - 0.5 / 0.8) < 0.04
    counts = torch.bincount(Sampling(top_k=3, temperature=1.0).choose(logits, generators), minlength=4).tolist()
    assert counts[3] == 0 and abs(counts[2] / 4000 - 0.15 / 0.95) < 0.03
    hot = torch.bincount(Sampling(temperature=100.0).choose(logits, generators), minlength=4).tolist()
    assert min(hot) > 800  # nearly uniform


def test_sampling_options_are_checked_in_one_report():
    from megatron_bridge.config.errors import ConfigValidationError

    with pytest.raises(ConfigValidationError) as exc:
        Sampling(temperature=-1.0, top_k=-2, top_p=0.0).check()
    text = str(exc.value)
    assert "temperature: must be 0 (greedy) or positive, got -1.0" in text
    assert "top_k: must be 0 (off) or positive, got -2" in text
    assert "top_p: must be in (0, 1], got 0.0" in text
    with pytest.raises(ConfigValidationError, match="0 means greedy decoding, which top_k and top_p do not change"):
        Sampling(temperature=0.0, top_p=0.9).check()


# ---------------------------------------------------------------------- stopping and chat
def test_stop_strings_and_stop_tokens_end_a_generation(models, tmp_path):
    source = models["llama"]
    tok = hf_tokenizer(source)
    full = generate(source, PROMPTS[0], max_new_tokens=NEW, ignore_eos=True)[0]
    ids = full.token_ids
    k = next(i for i in range(4, NEW - 2) if tok.decode(ids[i : i + 2]).isascii() and tok.decode(ids[i : i + 2]).strip())
    stop = tok.decode(ids[k : k + 2]).strip()
    g = generate(source, PROMPTS[0], max_new_tokens=NEW, stop=["never appears", stop], ignore_eos=True)[0]
    decoded = tok.decode(g.token_ids)
    assert g.finish_reason == "stop" and g.token_ids == ids[: len(g.token_ids)]
    assert stop not in g.text and decoded[len(g.text) :].startswith(stop) and decoded.startswith(g.text)
    assert stop not in tok.decode(g.token_ids[:-1])  # ended at the token that completed the stop string

    # a stop token from generation_config.json, as transformers reads it
    eos_at = next(i for i in range(3, NEW) if ids[i] not in ids[:i])
    copy = shutil.copytree(source, tmp_path / "llama")
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": ids[eos_at]}))
    g = generate(str(copy), PROMPTS[0], max_new_tokens=NEW)[0]
    assert (g.finish_reason, g.token_ids, g.text) == ("eos", ids[: eos_at + 1], tok.decode(ids[:eos_at]))
    assert transformers_greedy(str(copy), PROMPTS[:1], NEW, eos=True)[0] == g.token_ids


def test_chat_prompts_are_rendered_with_the_template(models):
    source = models["llama"]
    rendered = "<|im_start|>user\nWho sees the cat?<|im_end|>\n<|im_start|>assistant\n"
    chat, conversation, plain = generate(
        source, ["Who sees the cat?", [{"role": "user", "content": "Who sees the cat?"}]], chat=True, max_new_tokens=5, ignore_eos=True
    ) + generate(source, rendered, max_new_tokens=5, ignore_eos=True)
    assert chat.prompt_token_ids == conversation.prompt_token_ids == hf_tokenizer(source).encode(rendered).ids
    assert chat.token_ids == conversation.token_ids == plain.token_ids


# ---------------------------------------------------------------------- the command line
@pytest.mark.slow
def test_cli_json_and_text_output_and_user_errors(models, checkpoints, tmp_path):
    prompts_file = tmp_path / "prompts.jsonl"
    conversation = [{"role": "user", "content": "Hi!"}]
    prompts_file.write_text(json.dumps({"prompt": "A dog"}) + "\n\n" + json.dumps({"messages": conversation}) + "\n")
    unfinished = tmp_path / "unfinished"
    os.makedirs(unfinished / "iter_0000003.incomplete")
    no_shard = shutil.copytree(checkpoints["llama"], tmp_path / "no_shard")
    shard = sorted(p for p in (no_shard / "iter_0000000").iterdir() if p.suffix == ".distcp")[-1]
    shard.unlink()
    long_prompt = " ".join(["the cat sees the red ball"] * 20)
    runs = {
        "json": ("generate", models["llama"], "--prompt", "The cat sees", "--prompts", str(prompts_file), "--max-new-tokens", "6", "--json"),
        "text": ("generate", models["qwen3"], "--prompt", "The cat sees", "--max-new-tokens", "4", "--ignore-eos"),
        "missing": ("generate", str(tmp_path / "nothing"), "--prompt", "x"),
        "unfinished": ("generate", str(unfinished), "--prompt", "x"),
        "no_shard": ("generate", str(no_shard), "--prompt", "x"),
        "too_long": ("generate", models["qwen3"], "--prompt", long_prompt),
        "no_template": ("generate", models["qwen3"], "--chat", "--prompt", "Hi!"),
        "no_prompt": ("generate", models["qwen3"]),
    }
    visible = torch.cuda.device_count()
    nproc = max(2, visible + 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        done = {key: pool.submit(mbridge, *args) for key, args in runs.items()}
        # NCCL for more processes on this machine than it has GPUs: refused before the model is built
        done["nccl"] = pool.submit(mbridge, "generate", models["qwen3"], "--prompt", "x", "--backend", "nccl",
                                   LOCAL_WORLD_SIZE=str(nproc))  # fmt: skip
        procs = {key: future.result() for key, future in done.items()}

    proc = procs["json"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    expected = generate(models["llama"], ["The cat sees", "A dog", conversation], max_new_tokens=6)
    assert [(r["prompt"], r["text"], r["token_ids"]) for r in lines] == [(g.prompt, g.text, g.token_ids) for g in expected]
    assert "tokens/s" in proc.stderr
    proc = procs["text"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "=== prompt 1 (4 new tokens, length)" in proc.stdout and proc.stdout.rstrip().endswith("tokens/s")

    errors = {
        "missing": "does not exist",
        "unfinished": "no complete checkpoint in",
        "no_shard": f"is incomplete: shard {shard.name} is missing",
        "too_long": "prompt 1 has",
        "no_template": "has no chat template, which --chat and conversation prompts need",
        "no_prompt": "give a prompt: --prompt TEXT",
        "nccl": f"--backend: nccl needs one GPU per process, but this machine runs {nproc} processes",
    }
    for key, message in errors.items():
        proc = procs[key]
        assert proc.returncode == 2, (key, proc.stdout[-2000:], proc.stderr[-2000:])
        assert message in proc.stderr and "Traceback" not in proc.stderr, (key, proc.stderr[-2000:])
    assert "iter_0000003.incomplete, a save that did not finish" in procs["unfinished"].stderr
    assert "longer than the model's sequence length allows: it takes 64 tokens" in procs["too_long"].stderr
    assert "or set --backend=gloo" in procs["nccl"].stderr


def test_other_user_errors_are_one_message(models, tmp_path):
    from megatron_bridge.config.errors import ConfigValidationError
    from megatron_bridge.inference.errors import PromptError
    from megatron_bridge.inference.model import load_model, tensor_parallel_size
    from megatron_bridge.inference.prompts import read_prompts

    llama = models["llama"]
    with pytest.raises(SourceError, match="is a file; a model source is"):
        resolve(os.path.join(llama, "config.json"))
    with pytest.raises(SourceError, match="--step picks a checkpoint iteration, but .* is a Hugging Face model directory"):
        resolve(llama, step=3)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(llama, "config.json"), bare)
    with pytest.raises(SourceError, match="has a config.json but no weights"):
        resolve(str(bare))
    with pytest.raises(SourceError, match=r"--tp 2 must equal the number of processes \(1\)"):
        tensor_parallel_size(2)
    with pytest.raises(PromptError, match="prompt 2 is empty"):
        generate(llama, ["The cat", ""])
    with pytest.raises(ConfigValidationError, match=r"backend: unknown process-group backend 'cuda' \(use one of \['auto', 'nccl', 'gloo'\]\)"):
        generate(llama, "The cat", backend="cuda")
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(PromptError, match=r"prompts.jsonl:2: expected \{\"prompt\": ...\} or"):
        read_prompts(str(lines))
    lines.write_text("{not json\n")
    with pytest.raises(PromptError, match="prompts.jsonl:1: not JSON"):
        read_prompts(str(lines))
    other = shutil.copytree(llama, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(SourceError, match="cannot be loaded:\n  - .*architectures=\\['GPT2LMHeadModel'\\] is not supported"):
        with load_model(str(other)):
            pass


def test_a_checkpoint_removed_while_it_is_read_is_one_message(tmp_path, monkeypatch):
    """A run still training with `most_recent_k` removes an older checkpoint as `generate` reads
    it: the metadata vanished between the check that it exists and its reading, a traceback."""
    import errno

    from megatron_bridge.inference import sources

    directory = tmp_path / "iter_0000002"
    directory.mkdir()
    for name in (*sources.CHECKPOINT_FILES, sources.RUN_CONFIG_FILE):
        (directory / name).write_bytes(b"")

    def removed_meanwhile(path):
        shutil.rmtree(path)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.path.join(path, ".metadata"))

    monkeypatch.setattr(sources, "read_metadata", removed_meanwhile)
    with pytest.raises(SourceError) as caught:
        sources.check_complete(str(directory))
    assert str(caught.value) == (
        f"the checkpoint {str(directory)!r} was removed while it was read (a run still saving removes its older "
        "checkpoints: checkpoint.most_recent_k); run again for its latest one"
    )


def test_a_first_save_under_way_is_not_called_a_stopped_run(tmp_path):
    """Only `iter_N.incomplete` in the directory: a run saving its first checkpoint right now as
    well as one killed while saving; the message said the run had stopped."""
    (tmp_path / "iter_0000002.incomplete").mkdir()
    with pytest.raises(SourceError) as caught:
        resolve(str(tmp_path))
    assert str(caught.value) == (
        f"no complete checkpoint in {str(tmp_path)!r}: only iter_0000002.incomplete, a save that did not finish "
        "(a run still writing it, or one stopped while it did)"
    )


def test_truncated_shard_is_reported(checkpoints, tmp_path):
    copy = shutil.copytree(checkpoints["qwen3"], tmp_path / "truncated")
    shard = sorted(p for p in (copy / "iter_0000000").iterdir() if p.suffix == ".distcp")[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(SourceError, match=f"shard {shard.name} has {size // 2} bytes, its metadata needs"):
        resolve(str(copy))


@pytest.mark.slow
def test_tensor_parallel_generation_under_torchrun_equals_one_process(models):
    import subprocess

    from factories import backend_for, source_tree_env, torchrun


    backend = backend_for(2)
    cmd = [*torchrun(2), "-m", "megatron_bridge", "generate", models["llama"],
           *[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", "12", "--ignore-eos", "--json",
           "--backend", backend]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=source_tree_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    single = generate(models["llama"], PROMPTS, max_new_tokens=12, ignore_eos=True, backend=backend)
    assert [r["token_ids"] for r in lines] == [g.token_ids for g in single]
