"""Bad data is a clear config error before the model is built, each with its message; a dry run
on a machine without the data notes it as not found instead of failing."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from factories import source_tree_env, tiny_config, tiny_model
from text_data import train_tokenizer, write_jsonl

from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.data.checks import check_data
from megatron_bridge.data.indexed import IndexedDatasetWriter, write_index
from megatron_bridge.training.config import FinetuningDatasetConfig, GPTDatasetConfig, ValidationConfig, runtime_config_update
from megatron_bridge.training.tokenizers.config import TokenizerConfig


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300)


def indexed(prefix, largest=200):
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for start in range(0, 400, 20):
        writer.add_document(np.append(np.arange(start, start + 19) % largest, largest), [20])
    writer.finalize()
    return str(prefix)


def problems(cfg, tokenizer=None, dry_run=False):
    runtime_config_update(cfg)
    report = check_data(cfg, tokenizer, dry_run=dry_run)
    return [str(p) for p in report.problems.items], report.not_found


def gpt(data_path, split="90,10,0", **kw):
    """On `indexed` data: its 20 documents leave none for validation at the default split 99,1,0."""
    return tiny_config(dataset=GPTDatasetConfig(seq_length=32, data_path=data_path, split=split, num_workers=0), **kw)


def sft(root, **kw):
    data = {k: kw.pop(k) for k in ("column_mapping", "splits") if k in kw}
    return tiny_config(dataset=FinetuningDatasetConfig(dataset_root=str(root), seq_length=32, num_workers=0, **data), **kw)


def hf_tokenizer(path):
    return TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path)


def test_indexed_dataset_problems(tmp_path, tok_dir):
    good = indexed(tmp_path / "good")
    assert problems(gpt(good)) == ([], [])
    no_idx = indexed(tmp_path / "no_idx")
    os.remove(no_idx + ".idx")
    truncated = indexed(tmp_path / "cut")
    with open(truncated + ".bin", "r+b") as f:
        f.truncate(100)
    assert problems(gpt(f"{no_idx} {tmp_path}/absent {truncated}"))[0] == [
        f"dataset.data_path: {no_idx}.bin exists but {no_idx}.idx does not (an interrupted or partial copy? preprocess or copy the pair again)",
        f"dataset.data_path: {tmp_path}/absent.bin/.idx does not exist (run `mbridge data preprocess` to make it, or fix the prefix (the path without .bin/.idx))",
        f"dataset.data_path: {truncated}.bin has 100 bytes but its .idx describes 800 (the two files come from different runs or a copy was cut short; preprocess again)",
    ]
    piped = indexed(tmp_path / "piped")
    os.remove(piped + ".idx")
    os.mkfifo(piped + ".idx")  # reading a pipe would block: refused by what it is, before any read
    directory = str(tmp_path / "dir")
    os.makedirs(directory + ".bin")
    assert problems(gpt(f"{piped} {directory}"))[0] == [
        f"dataset.data_path: {piped}.idx is a FIFO (named pipe), not a regular file (point the prefix at a .bin/.idx pair of files)",
        f"dataset.data_path: {directory}.bin is a directory, not a regular file (point the prefix at a .bin/.idx pair of files)",
    ]
    other_vocab = indexed(tmp_path / "big", largest=299)  # made with a 300-token vocabulary
    assert problems(gpt(other_vocab))[0] == [
        f"dataset.data_path: {other_vocab} holds token id 299, outside the tokenizer's vocabulary of 256 "
        "(it was made with another tokenizer: preprocess with this one (or use the tokenizer it was made with))"
    ]


def test_a_directory_or_a_link_loop_given_as_prefix(tmp_path):
    """The directory that holds the data is named with the prefixes in it (it read as "dir.bin/.idx
    does not exist"); a .bin that is a link to itself is a broken link, not a missing file."""
    data = tmp_path / "data"
    data.mkdir()
    first, second = indexed(data / "web_text_document"), indexed(data / "books_text_document")
    (tmp_path / "empty").mkdir()
    os.symlink("loop.bin", tmp_path / "loop.bin")
    what = "is a directory, not a prefix (a prefix is the path of a .bin/.idx pair without the suffix)"
    assert problems(gpt(f"{data} {tmp_path}/empty {tmp_path}/loop"))[0] == [
        f"dataset.data_path: {data} {what} (the prefixes in it are {second}, {first})",
        f"dataset.data_path: {tmp_path}/empty {what} (it holds no .bin/.idx pairs)",
        f"dataset.data_path: {tmp_path}/loop.bin is a broken link, not a regular file (point the prefix at a .bin/.idx pair of files)",
    ]


@pytest.mark.timeout(60)
def test_a_blend_of_more_prefixes_than_the_open_file_limit_allows(tmp_path):
    """megatron-core keeps ~9 files open per prefix (train and valid splits): 150 prefixes passed a
    soft limit of 1,024 and building the datasets failed with "Too many open files" after the model
    was built. The soft limit is raised up to the hard one; past the hard one it is a config problem.
    In a fresh process: the limits are the process's."""
    prefix = indexed(tmp_path / "shard")
    script = textwrap.dedent(f"""
        import resource
        from factories import tiny_config
        from megatron_bridge.config.errors import ConfigValidationError
        from megatron_bridge.data.checks import check_before_build
        from megatron_bridge.training.config import GPTDatasetConfig, runtime_config_update
        data = GPTDatasetConfig(seq_length=32, data_path=" ".join([{prefix!r}] * 150), split="90,10,0", num_workers=0)
        cfg = tiny_config(dataset=data)
        runtime_config_update(cfg)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard >= 4096:
            resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
            check_before_build(cfg, None)
            print("raised to the hard limit:", resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard))
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        try:
            check_before_build(cfg, None)
        except ConfigValidationError as exc:
            print(exc.errors)
    """)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = source_tree_env(PYTHONPATH=os.pathsep.join([tests, source_tree_env()["PYTHONPATH"]]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=50)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == str([
        "dataset.data_path: its 150 prefixes keep about 1,350 files open while training (3 for each prefix, 3 more "
        "for each split drawn from it); with the rest of the run that is over this process's limit of 1,024 open files "
        "(raise the limit where the job starts (`ulimit -n`; a scheduler's or container's own setting), or merge small "
        "prefixes into fewer, larger ones (`mbridge data preprocess` over their source files))"
    ]), out.stdout
    assert lines[:-1] in ([], ["raised to the hard limit: True"]), out.stdout


def test_an_indexed_dataset_of_floats_is_not_token_ids(tmp_path):
    """megatron-core's writer also stores floats: such a prefix failed with "cannot convert float
    NaN to integer" while its token ids were checked."""
    writer = IndexedDatasetWriter(str(tmp_path / "features"), np.float64)
    for _ in range(20):
        writer.add_document(np.array([1.5, np.nan, 3.0]), [3])
    writer.finalize()
    assert problems(gpt(str(tmp_path / "features")))[0] == [
        f"dataset.data_path: {tmp_path}/features stores float64 values, not token ids (point the prefix at a token "
        "dataset (`mbridge data preprocess` writes one))"
    ]


def test_index_arrays_that_lie(tmp_path):
    """An .idx whose header matches the .bin but whose arrays do not: refused before megatron-core
    reads them (a negative length made its epoch count loop forever, an offset past the .bin
    failed with a traceback in the middle of building)."""
    lengths = np.full(20, 20, dtype=np.int32)
    documents = np.arange(21, dtype=np.int64)
    negative = indexed(tmp_path / "negative")
    bad = lengths.copy()
    bad[3], bad[4] = -20, 60  # the total, and so the header's .bin size, stay right
    write_index(negative + ".idx", np.uint16, bad, documents)
    moved = indexed(tmp_path / "moved")
    pointers = np.arange(20, dtype=np.int64) * 40
    pointers[5] = 10**12
    with open(moved + ".idx", "r+b") as f:
        f.seek(34 + 4 * 20)
        f.write(pointers.tobytes())
    fix = "(the index is damaged or was not written by megatron-core's writer; preprocess the data again)"
    assert problems(gpt(f"{negative} {moved}"))[0] == [
        f"dataset.data_path: {negative}.idx gives sequence 3 a negative length (-20) {fix}",
        f"dataset.data_path: {moved}.idx puts sequence 5 at byte 1,000,000,000,000 of the .bin, where the sequences before it end at byte 200 {fix}",
    ]


def test_a_split_without_documents(tmp_path):
    """20 documents at the default split 99,1,0 leave none for validation: megatron-core would
    repeat the empty split's epochs forever; the check names the split and the ways out."""
    few = indexed(tmp_path / "few")
    assert problems(gpt(few, split=None))[0] == [
        f"dataset.split: '99,1,0' gives the valid split 0 of the 20 documents of {few} (give the valid split a larger "
        "share (e.g. dataset.split='90,10,0') or use more data; no validation: validation.eval_iters=0)"
    ]
    assert problems(gpt(few, split=None, validation=ValidationConfig(eval_iters=0)))[0] == []
    assert problems(gpt(few, split="90,10,0"))[0] == []
    empty = str(tmp_path / "empty")
    writer = IndexedDatasetWriter(empty, np.uint16)
    writer.add_document([], [0])
    writer.add_document([], [0])
    writer.finalize()
    assert problems(gpt(f"{few} {empty}", split=None, validation=ValidationConfig(eval_iters=0)))[0] == [
        f"dataset.split: '99,1,0' gives the train split 2 of the 2 documents, all empty, of {empty} (give the train "
        "split a larger share (e.g. dataset.split='90,10,0') or use more data)"
    ]
    per_split = tiny_config(dataset=GPTDatasetConfig(seq_length=32, blend_per_split=[([few], None), ([empty], None), None], num_workers=0))
    assert problems(per_split)[0] == [
        f"dataset.blend_per_split.valid: {empty} has no tokens (its 2 documents are empty) (give the valid split a "
        "prefix with data; no validation: validation.eval_iters=0)"
    ]


def test_per_split_blends_are_checked_at_blend_per_split():
    """megatron-core's message about a per-split blend ("blend per split prefixes and weights
    ...") named dataset.blend; the problem is reported at the field the user set."""
    def problems(blend_per_split):
        cfg = tiny_config(dataset=GPTDatasetConfig(seq_length=32, blend_per_split=blend_per_split, num_workers=0))
        with pytest.raises(ConfigValidationError) as err:
            runtime_config_update(cfg, world_size=1)
        return err.value.errors

    assert problems([(["a", "b"], [1.0]), None, None]) == [
        "dataset.blend_per_split.train: 2 prefixes but 1 weights (give one weight per prefix)"
    ]
    assert "dataset.blend_per_split.test: 1 prefixes but 2 weights" in problems(
        [(["a"], None), (["b"], None), (["c"], [0.5, 0.5])]
    )[0]
    assert problems([(["a"], None), (["b"], None)]) == [
        "dataset.blend_per_split: has 2 entries "
        "(give three blends, [train, valid, test] (null for a split without data))"
    ]


def test_blend_weights_that_megatron_core_would_assert_on(tmp_path):
    """A weight of 0, a negative, inf (1e309) or NaN, in data_path, blend or blend_per_split, is a
    config problem; megatron-core's BlendedDataset asserted on them after the model was built."""
    a, b = indexed(tmp_path / "a"), indexed(tmp_path / "b")
    fix = "(give each prefix a weight > 0, or leave it out (dataset.blend_phases can bring a prefix in at a later iteration))"
    for data_path, shown in [(f"0 {a} 1 {b}", f"0.0 for {a}"), (f"0 {a} 0 {b}", f"0.0 for {a}, 0.0 for {b}"),
                             (f"1e309 {a} 1 {b}", f"inf for {a}"), (f"1 {a} -2 {b}", f"-2.0 for {b}")]:  # fmt: skip
        with pytest.raises(ConfigValidationError) as err:
            runtime_config_update(gpt(data_path))
        assert err.value.errors == [f"dataset.data_path: blend weights must be finite numbers > 0, got {shown} {fix}"]
    blend = GPTDatasetConfig(seq_length=32, blend=([a, b], [1.0, float("nan")]), split="90,10,0", num_workers=0)
    per_split = GPTDatasetConfig(seq_length=32, blend_per_split=[([a, b], [1.0, 0.0]), ([b], [1.0, 2.0]), None], num_workers=0)
    for data, expected in [
        (blend, [f"dataset.blend: blend weights must be finite numbers > 0, got nan for {b} {fix}"]),
        (per_split, [f"dataset.blend_per_split.train: blend weights must be finite numbers > 0, got 0.0 for {b} {fix}",
                     "dataset.blend_per_split.valid: 1 prefixes but 2 weights (give one weight per prefix)"]),
    ]:  # fmt: skip
        with pytest.raises(ConfigValidationError) as err:
            runtime_config_update(tiny_config(dataset=data))
        assert err.value.errors == expected
    assert problems(gpt(f"0.25 {a} 0.75 {a}")) == ([], [])  # the same prefix twice is a valid blend


def test_a_split_or_per_split_blend_without_training_data(tmp_path):
    """'0,100,0' or a per-split blend whose train entry is null build no training set: found only
    after the model was built, with a fix about build_datasets; now named at the setting."""
    few = indexed(tmp_path / "few")
    assert problems(gpt(few, split="0,100,0"))[0] == [
        "dataset.split: '0,100,0' gives the train split no share, but train.train_iters=20 asks for training (give the "
        "train split a share, e.g. dataset.split='99,1,0' (or set validation.skip_train=true to only evaluate))"
    ]
    per_split = tiny_config(dataset=GPTDatasetConfig(seq_length=32, blend_per_split=[None, ([few], None), None], num_workers=0))
    assert problems(per_split)[0] == [
        "dataset.blend_per_split: has no train blend (its first entry is null), but the run trains (give the first "
        "entry the training data (or set validation.skip_train=true to only evaluate))"
    ]
    assert problems(gpt(few, split="0,100,0", validation=ValidationConfig(skip_train=True)))[0] == []
    by_samples = gpt(few, split="0,100,0")
    by_samples.train.train_iters, by_samples.train.train_samples = None, 160
    assert "but train.train_samples=160 asks for training" in problems(by_samples)[0][0]


def test_a_tokenizer_larger_than_the_model(tok_dir, tmp_path):
    cfg = gpt(indexed(tmp_path / "d"), model=tiny_model(vocab_size=256), tokenizer=hf_tokenizer(tok_dir))
    assert problems(cfg)[0] == [
        "model.vocab_size: 256 is smaller than the tokenizer's vocabulary of 300 (token ids up to 299 would index past the "
        "embedding) (set model.vocab_size to at least 300, or leave it unset to take the tokenizer's)"
    ]


def test_a_chat_template_that_fails_while_rendering(tmp_path, tok_dir):
    """A template from a tokenizer's files that reaches past the sandbox, names what is not there
    or divides by zero is reported against tokenizer.chat_template, with the first row it fails
    on (it was a SecurityError/UndefinedError/ZeroDivisionError traceback)."""
    write_jsonl(tmp_path / "training.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    failures = {
        "{{ ''.__class__.__mro__ }}": "SecurityError: access to attribute '__class__' of 'str' object is unsafe.",
        "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools.name }}": "UndefinedError: 'tools' is undefined",
        "{% for m in messages %}{% generation %}{{ m.content / 0 }}{% endgeneration %}{% endfor %}": "TypeError: unsupported operand type(s) for /: 'str' and 'int'",
    }
    for template, error in failures.items():
        tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir, chat_template=template)
        assert problems(sft(tmp_path, model=tiny_model(vocab_size=300), tokenizer=tokenizer))[0] == [
            f"tokenizer.chat_template: {tmp_path}/training.jsonl line 1: the chat template fails on this conversation: "
            f"{error} (set tokenizer.chat_template to a template that renders this conversation)"
        ]


def test_a_chat_template_that_would_run_for_hours_or_render_gigabytes(tmp_path, tok_dir, monkeypatch):
    """Nested loops over the sandbox's ranges (100,000 each) would run for hours, and repeated
    strings would fill memory: each rendering is bounded in time and in characters."""
    import signal

    from megatron_bridge.data import chat

    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    write_jsonl(tmp_path / "training.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    failures = {
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}":
            "the chat template did not finish rendering this conversation in 0.5 s (does it loop over large ranges?)",
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}":
            "the chat template renders this conversation to over 67,108,864 characters",
    }  # fmt: skip
    signal.setitimer(signal.ITIMER_REAL, 100.0)  # an alarm of the caller's (as a test timeout sets)
    try:
        for template, error in failures.items():
            tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir, chat_template=template)
            assert problems(sft(tmp_path, model=tiny_model(vocab_size=300), tokenizer=tokenizer))[0] == [
                f"tokenizer.chat_template: {tmp_path}/training.jsonl line 1: {error} "
                "(set tokenizer.chat_template to a template that renders this conversation)"
            ]
        assert 90.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 100.0  # still armed, less the time spent
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def test_finetuning_text_that_is_not_utf8(tmp_path):
    (tmp_path / "training.jsonl").write_bytes(b'{"input": "1 2", "output": "3"}\n{"input": "caf\xe9", "output": "4"}\n')
    assert problems(sft(tmp_path))[0] == [
        f"dataset.dataset_root: {tmp_path}/training.jsonl line 2: not valid JSON (not UTF-8 text (byte 0xe9), column 15) (fix or remove that row)"
    ]


def test_a_tokenizer_json_the_library_cannot_read(tmp_path):
    """The tokenizers library raises a bare Exception for a tokenizer.json it cannot parse: a
    problem naming the file, not that traceback."""
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    found = problems(tiny_config(tokenizer=hf_tokenizer(str(tmp_path))))[0]
    assert found == [
        f"tokenizer.tokenizer_model: '{tmp_path}/tokenizer.json' is not a tokenizer the tokenizers library reads: data did "
        "not match any variant of untagged enum ModelUntagged at line 1 column 45 (use a tokenizer that loads from local files)"
    ]


def test_finetuning_file_problems(tmp_path, tok_dir):
    root = tmp_path / "bad_json"
    root.mkdir()
    (root / "training.jsonl").write_text('{"input": "1 2", "output": "3"}\n\n{"input": "4", "output": 5,}\n')
    assert problems(sft(root))[0] == [f"dataset.dataset_root: {root}/training.jsonl line 3: not valid JSON (Expecting property name enclosed in double quotes, column 28) (fix or remove that row)"]

    root = tmp_path / "text"
    root.mkdir()
    write_jsonl(root / "training.jsonl", [{"input": "What is two plus two?", "output": "Four."}])
    assert problems(sft(root))[0] == [
        f"tokenizer.tokenizer_type: NullTokenizer reads space-separated token ids below 256, but {root}/training.jsonl line 1 "
        "has 'What is two plus two?' in 'input' (use a HuggingFaceTokenizer (tokenizer.tokenizer_model=DIR) for text, or write token ids)"
    ]
    assert problems(sft(root, tokenizer=hf_tokenizer(tok_dir)))[0] == []  # text is fine with a real tokenizer

    root = tmp_path / "columns"
    root.mkdir()
    write_jsonl(root / "training.jsonl", [{"prompt": "1 2", "response": "3"}])
    assert problems(sft(root))[0] == [
        f"dataset.dataset_root: {root}/training.jsonl: unknown column 'input' (input), 'output' (output); its columns are "
        "['prompt', 'response'] (use 'input'/'output' or 'messages' columns, or map yours: dataset.column_mapping={input: NAME, output: NAME})"
    ]
    assert problems(sft(root, column_mapping={"input": "question", "output": "response"}))[0] == [
        f"dataset.column_mapping: {root}/training.jsonl: unknown column 'question' (input); its columns are ['prompt', 'response'] "
        "(use 'input'/'output' or 'messages' columns, or map yours: dataset.column_mapping={input: NAME, output: NAME})"
    ]
    assert problems(sft(root, column_mapping={"input": "prompt", "output": "response"}))[0] == []

    root = tmp_path / "chat"
    root.mkdir()
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    write_jsonl(root / "training.jsonl", [good, {"messages": [{"role": "user", "content": "Hi"}, {"content": "Hello."}]}])
    chat_tokenizer = hf_tokenizer(tok_dir)
    chat_tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert problems(sft(root, tokenizer=chat_tokenizer))[0] == [
        f"dataset.dataset_root: {root}/training.jsonl line 2: messages[1] has no 'role' (each message needs a role such as user "
        "or assistant, and its content) (fix or remove that row)"
    ]
    assert problems(sft(root))[0] == [
        f"tokenizer.tokenizer_type: chat data ({root}/training.jsonl) needs a tokenizer with a chat template, not a NullTokenizer "
        "(use a HuggingFaceTokenizer (tokenizer.tokenizer_model=DIR))"
    ]
    assert problems(sft(root, tokenizer=hf_tokenizer(tok_dir)))[0] == [
        "tokenizer.chat_template: the tokenizer has no chat template (set tokenizer.chat_template to a Jinja template) "
        "(set tokenizer.chat_template, or use a tokenizer whose files have one)"
    ]
    # a template that hides earlier answers: the first conversation shows it, before anything is built
    two_turns = {"messages": good["messages"] + [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]}
    write_jsonl(root / "training.jsonl", [two_turns])
    chat_tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role + ': ' }}{{ '(earlier answer)' if m.role == 'assistant' and not loop.last "
        "else m.content }}{{ '\\n' }}{% endfor %}"
    )
    assert problems(sft(root, tokenizer=chat_tokenizer))[0] == [
        f"tokenizer.chat_template: {root}/training.jsonl line 1: the assistant turn at messages[1] appears in the whole "
        "conversation neither as the template renders it when it is the last turn nor as that without its reasoning "
        "(up to </think>), so its tokens cannot be located; use a template that marks assistant text with "
        "{% generation %} blocks (set tokenizer.chat_template to a template that renders this conversation)"
    ]


def test_a_hub_id_without_a_local_copy(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert problems(sft("someorg/chat-data"))[0] == [
        "dataset.dataset_root: 'someorg/chat-data' is not a local path; datasets are read from local files only, and a Hub id is "
        "not downloaded (make a local copy where there is network (datasets.load_dataset('someorg/chat-data').save_to_disk(DIR)) and use DIR)"
    ]


def test_tokenizer_settings_are_checked():
    cfg = tiny_config(tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=256, chat_template="{{ x }}"))
    with pytest.raises(ConfigValidationError, match=r"tokenizer.chat_template: only a HuggingFaceTokenizer reads it \(tokenizer_type='NullTokenizer'\)"):
        runtime_config_update(cfg)
    cfg = tiny_config(tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="x", hf_tokenizer_kwargs={"trust_remote_code": True}))
    with pytest.raises(ConfigValidationError, match="tokenizer.hf_tokenizer_kwargs.trust_remote_code: a config cannot run code from a tokenizer directory"):
        runtime_config_update(cfg)


@pytest.mark.timeout(300)
def test_errors_come_before_the_model_is_built(tmp_path, tok_dir, monkeypatch):
    from megatron_bridge.training import build
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(build, "build_model", no_model)
    root = tmp_path / "sft"
    root.mkdir()
    write_jsonl(root / "training.jsonl", [{"input": "What is two plus two?", "output": "Four."}])
    with pytest.raises(ConfigValidationError, match="NullTokenizer reads space-separated token ids below 256"):
        pretrain(sft(root), forward_step)
    prefix = indexed(tmp_path / "d")
    os.remove(prefix + ".idx")
    cfg = gpt(prefix, model=tiny_model(vocab_size=256), tokenizer=hf_tokenizer(tok_dir))
    with pytest.raises(ConfigValidationError) as err:
        pretrain(cfg, forward_step)
    assert [e.split(":")[0] for e in err.value.errors] == ["model.vocab_size", "dataset.data_path"]  # all at once


@pytest.mark.timeout(300)
def test_dry_run_notes_data_not_on_this_machine(tmp_path, tok_dir, capsys):
    from megatron_bridge.cli.main import main

    code = main(["pretrain", "--recipe", "tiny_gpt_pretrain_config", "--dry-run", "--recipe-arg", "data_paths=[/cluster/data/web_text_document]", "--recipe-arg", "tokenizer=/cluster/tok"])
    out = capsys.readouterr().out
    assert code == 0
    assert "# data:" in out
    assert "tokenizer.tokenizer_model: '/cluster/tok': not found on this machine" in out
    assert "dataset.data_path: /cluster/data/web_text_document.bin/.idx: not found on this machine" in out

    prefix = indexed(tmp_path / "d", largest=299)
    code = main(["pretrain", "--recipe", "tiny_gpt_pretrain_config", "--dry-run", "--recipe-arg", f"data_paths=[{prefix}]"])
    captured = capsys.readouterr()
    assert code == 2  # present here, and unusable: an error
    assert f"dataset.data_path: {prefix} holds token id 299, outside the tokenizer's vocabulary of 256" in captured.err

    root = tmp_path / "sft"
    root.mkdir()
    (root / "training.jsonl").write_text('{"input": "1", "output": "2"}\n')
    code = main(["finetune", "--recipe", "tiny_gpt_finetune_config", "--dry-run", "--recipe-arg", f"dataset_root={root}", "--recipe-arg", f"pretrained_checkpoint={root}"])
    assert code == 0 and "all found and readable" in capsys.readouterr().out
