"""Chat fine-tuning: `messages` rendered with the chat template, the loss on assistant turns only
(checked token by token), training on it; the tokenizer settings that reach the tokenizer."""

import json
import math
import random
from statistics import mean

import pytest
from factories import tiny_config, tiny_model
from text_data import CHATML, OBJECTS, QWEN3, SUBJECTS, sentence, train_tokenizer, write_jsonl

from megatron_bridge.data.chat import ChatFormatError, ChatRenderer
from megatron_bridge.data.finetuning import SFTDataset
from megatron_bridge.runtime.tokenizers.tokenizer import HuggingFaceTokenizer

OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300, chat_template=CHATML)


CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Who sees the map?"},
    {"role": "assistant", "content": "The cat sees the map."},
    {"role": "user", "content": "And the café ✓?"},
    {"role": "assistant", "content": "A dog likes the café ✓ after lunch."},
]


def test_loss_mask_covers_exactly_the_assistant_tokens(tok_dir):
    tok = HuggingFaceTokenizer(tok_dir)
    ids, flags = ChatRenderer(tok).encode(CONVERSATION)
    # Independently: the pieces the ChatML template writes, tokenized one by one. An assistant
    # turn is its content and its end-of-turn marker (with the newline the template adds).
    expected_ids, expected_flags = [], []
    for m in CONVERSATION:
        is_assistant = m["role"] == "assistant"
        for text, flag in ((f"<|im_start|>{m['role']}\n", False), (m["content"], is_assistant), ("<|im_end|>", is_assistant), ("\n", is_assistant)):
            piece = tok.tokenize(text)
            expected_ids += piece
            expected_flags += [int(flag)] * len(piece)
    assert ids.tolist() == expected_ids
    assert flags.tolist() == expected_flags
    assert tok.detokenize([i for i, f in zip(ids, flags) if f], skip_special_tokens=False) == (
        "The cat sees the map.<|im_end|>\nA dog likes the café ✓ after lunch.<|im_end|>\n"
    )
    sample = SFTDataset([(ids, flags)], seq_length=len(ids), num_samples=1, seed=0, pad_id=0)[0]
    assert sample["labels"] == expected_ids[1:]
    for j, counted in enumerate(sample["loss_mask"]):  # label j is token j + 1
        assert counted == expected_flags[j + 1], j


QWEN3_CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Who sees the map?"},
    {"role": "assistant", "content": "<think>\nThe cat was near it.\n</think>\n\nThe cat sees the map."},
    {"role": "user", "content": "And the café ✓?"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "look", "arguments": {"at": "café"}}}]},
    {"role": "tool", "content": "a dog"},
    {"role": "assistant", "reasoning_content": "The tool saw a dog.", "content": "A dog likes the café ✓."},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "You are welcome."},
]


def test_qwen3_template_multi_turn_mask_covers_the_assistant_spans_of_the_whole_rendering(tok_dir):
    """Qwen3's template drops the reasoning of assistant turns before the last user query and
    gives the last turn an empty <think> block: the mask covers each assistant turn as the whole
    conversation renders it (checked by hand: the text and the masked spans, literally)."""
    tok = HuggingFaceTokenizer(tok_dir, chat_template=QWEN3)
    text, spans = ChatRenderer(tok).assistant_spans(QWEN3_CONVERSATION)
    assert text == (
        "<|im_start|>system\nYou answer briefly.<|im_end|>\n"
        "<|im_start|>user\nWho sees the map?<|im_end|>\n"
        "<|im_start|>assistant\nThe cat sees the map.<|im_end|>\n"
        "<|im_start|>user\nAnd the café ✓?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "look", "arguments": {"at": "café"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na dog\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nA dog likes the café ✓.<|im_end|>\n"
        "<|im_start|>user\nThanks.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nYou are welcome.<|im_end|>\n"
    )
    expected = [
        "The cat sees the map.<|im_end|>\n",
        '<tool_call>\n{"name": "look", "arguments": {"at": "café"}}\n</tool_call><|im_end|>\n',
        "A dog likes the café ✓.<|im_end|>\n",
        "<think>\n\n</think>\n\nYou are welcome.<|im_end|>\n",
    ]
    assert [text[a:b] for a, b in spans] == expected
    ids, flags = ChatRenderer(tok).encode(QWEN3_CONVERSATION)
    assert tok.detokenize(ids.tolist(), skip_special_tokens=False) == text
    assert tok.detokenize([i for i, f in zip(ids, flags) if f], skip_special_tokens=False) == "".join(expected)
    # every masked token lies inside a span, every span is covered by whole tokens
    _, offsets = tok.tokenize_with_offsets(text)
    assert {(a, b) for (a, b), f in zip(offsets, flags) if f} == {
        (a, b) for a, b in offsets if any(s <= a and b <= e for s, e in spans)
    }
    # Up to the tool call, the last user query is 'And the café ✓?': the turn after it keeps its reasoning
    text, spans = ChatRenderer(tok).assistant_spans(QWEN3_CONVERSATION[:7])
    assert [text[a:b] for a, b in spans][1:] == [
        '<tool_call>\n{"name": "look", "arguments": {"at": "café"}}\n</tool_call><|im_end|>\n',
        "<think>\nThe tool saw a dog.\n</think>\n\nA dog likes the café ✓.<|im_end|>\n",
    ]


GENERATION_MARKED = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM_IN_LAST_USER = (  # as Mistral's templates place the system prompt
    "{%- set system = messages[0].content if messages[0].role == 'system' else '' %}"
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '[INST] ' + (system + '\\n\\n' if loop.index0 == ns.last and system else '') + m.content + ' [/INST]' }}"
    "{%- elif m.role == 'assistant' %}{{- ' ' + m.content + '</s>' }}{%- endif %}"
    "{%- endfor %}"
)


def test_generation_markers_and_templates_that_move_earlier_text(tok_dir):
    """A template's {% generation %} blocks are the mask (here without the newline after the end
    marker); a template that moves the system prompt into the last user turn still has each
    assistant turn located in the whole rendering."""
    marked = ChatRenderer(HuggingFaceTokenizer(tok_dir, chat_template=GENERATION_MARKED))
    text, spans = marked.assistant_spans(CONVERSATION)
    assert text == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    assert [text[a:b] for a, b in spans] == ["The cat sees the map.<|im_end|>", "A dog likes the café ✓ after lunch.<|im_end|>"]
    moved = ChatRenderer(HuggingFaceTokenizer(tok_dir, chat_template=SYSTEM_IN_LAST_USER))
    text, spans = moved.assistant_spans(CONVERSATION)
    assert text == (
        "[INST] Who sees the map? [/INST] The cat sees the map.</s>"
        "[INST] You answer briefly.\n\nAnd the café ✓? [/INST] A dog likes the café ✓ after lunch.</s>"
    )
    assert [text[a:b] for a, b in spans] == [" The cat sees the map.</s>", " A dog likes the café ✓ after lunch.</s>"]


@pytest.mark.parametrize(
    "template, message",
    [
        (  # earlier assistant turns replaced by a placeholder: nothing of the turn is left to find
            "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
            "{{ '(earlier answer)' if m.role == 'assistant' and not loop.last else m.content }}{{ '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
            "the assistant turn at messages[2] appears in the whole conversation neither as the template renders it "
            "when it is the last turn nor as that without its reasoning (up to </think>), so its tokens cannot be "
            "located; use a template that marks assistant text with {% generation %} blocks",
        ),
        (  # the text before a turn counts the turns
            "{{ messages | length }} turns\n{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}",
            "the chat template renders the conversation before messages[2] (an assistant turn) differently once "
            "that turn is added, so the turn's own text cannot be told apart; use a template that marks assistant "
            "text with {% generation %} blocks",
        ),
    ],
)
def test_templates_whose_turns_cannot_be_aligned_are_refused(tok_dir, template, message):
    with pytest.raises(ChatFormatError) as err:
        ChatRenderer(HuggingFaceTokenizer(tok_dir, chat_template=template)).encode(CONVERSATION)
    assert str(err.value) == message


def test_the_configured_template_overrides_the_tokenizers_own(tok_dir):
    own = HuggingFaceTokenizer(tok_dir)
    assert own.chat_template == CHATML
    other = HuggingFaceTokenizer(tok_dir, chat_template=OTHER_TEMPLATE)
    text, spans = ChatRenderer(other).assistant_spans(CONVERSATION[:3])
    assert text.startswith("[system] You answer briefly.\n[user]")
    assert [text[a:b] for a, b in spans] == ["[assistant] The cat sees the map.\n"]  # no generation prompt in this template
    with pytest.raises(ChatFormatError, match="the chat template is not valid Jinja: unexpected '}'"):
        ChatRenderer(HuggingFaceTokenizer(tok_dir, chat_template="{{ messages }"))


def test_hf_tokenizer_kwargs_reach_the_tokenizer(tok_dir, tmp_path):
    pytest.importorskip("transformers")
    tok = HuggingFaceTokenizer(tok_dir, hf_kwargs={"eos_token": "<|im_end|>"})
    assert tok.eod == tok._tok.token_to_id("<|im_end|>") != HuggingFaceTokenizer(tok_dir).eod
    # a directory without tokenizer.json (vocab.json + merges.txt) loads through transformers, offline
    from tokenizers import Tokenizer

    slow = tmp_path / "gpt2_files"
    slow.mkdir()
    Tokenizer.from_file(f"{tok_dir}/tokenizer.json").model.save(str(slow))
    (slow / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}))
    loaded = HuggingFaceTokenizer(str(slow), hf_kwargs={"add_prefix_space": False})
    text = "The old man paints a quiet song by the sea."
    assert loaded.tokenize(text) == HuggingFaceTokenizer(tok_dir).tokenize(text)
    assert loaded.eod == HuggingFaceTokenizer(tok_dir).eod


def chat_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        subject, obj = rng.choice(SUBJECTS), rng.choice(OBJECTS)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What does {subject} see? " + sentence(rng)},
                    {"role": "assistant", "content": f"{subject.capitalize()} sees {obj}."},
                ]
            }
        )
    return rows


@pytest.mark.timeout(300)
def test_chat_sft_trains_with_packing(tok_dir, tmp_path):
    from megatron_bridge.training.callbacks import Callback
    from megatron_bridge.training.config import FinetuningDatasetConfig, PackedSequenceSpecs, TrainingConfig, ValidationConfig
    from megatron_bridge.training.config import runtime_config_update
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain
    from megatron_bridge.training.tokenizers.config import TokenizerConfig
    from megatron_bridge.runtime.tokenizers.tokenizer import build_tokenizer

    data = tmp_path / "chat"
    data.mkdir()
    write_jsonl(data / "training.jsonl", chat_rows(300, seed=0))
    write_jsonl(data / "validation.jsonl", chat_rows(20, seed=1))
    losses = []

    class Record(Callback):
        def on_step_end(self, state, metrics):
            losses.append(metrics["lm loss"])

    cfg = tiny_config(
        model=tiny_model(seq_length=128),
        train=TrainingConfig(train_iters=30, global_batch_size=8, micro_batch_size=2),
        dataset=FinetuningDatasetConfig(dataset_root=str(data), seq_length=128, num_workers=0, packed_sequence_specs=PackedSequenceSpecs()),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir),
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
    )
    # The model's vocabulary comes from the tokenizer at validation; after that, the run changes
    # nothing in the config (runtime hooks go on the model's own copy).
    runtime_config_update(cfg, device="cpu")
    assert cfg.model.vocab_size == build_tokenizer(cfg.tokenizer).vocab_size == 300
    resolved = cfg.to_yaml()
    state = pretrain(cfg, forward_step, callbacks=[Record()])
    assert cfg.to_yaml() == resolved
    assert state.train_state.step == 30
    print("chat losses", [round(x, 2) for x in losses])
    assert mean(losses[-5:]) < mean(losses[:5]) - 1.0
    cached = list((data / "packed").glob("*.npz"))
    assert len(cached) == 2  # train and validation, packed once, next to the data


def qwen3_rows(n: int, seed: int) -> list[dict]:
    """Two-turn conversations whose first answer carries its reasoning (dropped by Qwen3's template)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        subject, obj = rng.choice(SUBJECTS), rng.choice(OBJECTS)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What does {subject} see? " + sentence(rng)},
                    {"role": "assistant", "content": f"<think>\n{sentence(rng)}\n</think>\n\n{subject.capitalize()} sees {obj}."},
                    {"role": "user", "content": "And then?"},
                    {"role": "assistant", "content": f"Then {subject} sees {rng.choice(OBJECTS)}."},
                ]
            }
        )
    return rows


@pytest.mark.timeout(300)
def test_multi_turn_chat_with_qwen3s_template_trains(tok_dir, tmp_path):
    from megatron_bridge.training.callbacks import Callback
    from megatron_bridge.training.config import FinetuningDatasetConfig, TrainingConfig, ValidationConfig
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    data = tmp_path / "chat"
    data.mkdir()
    write_jsonl(data / "training.jsonl", qwen3_rows(200, seed=0))
    losses = []

    class Record(Callback):
        def on_step_end(self, state, metrics):
            losses.append(metrics["lm loss"])

    cfg = tiny_config(
        model=tiny_model(seq_length=128),
        train=TrainingConfig(train_iters=16, global_batch_size=8, micro_batch_size=4),
        dataset=FinetuningDatasetConfig(dataset_root=str(data), seq_length=128, num_workers=0, do_validation=False),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir, chat_template=QWEN3),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
    )
    state = pretrain(cfg, forward_step, callbacks=[Record()])
    assert state.train_state.step == 16
    print("qwen3 chat losses", [round(x, 2) for x in losses])
    assert all(math.isfinite(x) for x in losses) and mean(losses[-4:]) < mean(losses[:4]) - 0.5


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_encoding_in_worker_processes_gives_the_samples_of_one_process(tok_dir):
    """`dataset.memmap_workers` > 1 encodes in spawned workers (1000 rows or more); the samples
    are the same, in the same order, for chat and prompt/answer rows."""
    from megatron_bridge.data.finetuning import SampleEncoder, encode_records
    from megatron_bridge.data.sft_records import CHAT, PROMPT, RecordFormat

    rng = random.Random(3)
    tok = HuggingFaceTokenizer(tok_dir)
    chats = [{"messages": [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]}
             for _ in range(1100)]
    pairs = [{"input": sentence(rng), "output": sentence(rng)} for _ in range(1100)]
    for rows, fmt in ((chats, RecordFormat(CHAT)), (pairs, RecordFormat(PROMPT))):
        encoder = SampleEncoder(tok, fmt, seq_length=64)
        one = encode_records(rows, encoder, workers=1)
        two = encode_records(rows, encoder, workers=2)
        assert len(one) == len(two) == len(rows)
        for (ids_a, flags_a), (ids_b, flags_b) in zip(one, two):
            assert list(ids_a) == list(ids_b) and list(flags_a) == list(flags_b)


@pytest.mark.timeout(300)
def test_throughput_counts_the_tokens_of_batches_padded_to_their_longest_sample(tok_dir, tmp_path):
    """Fine-tuning batches are padded to their longest sample, not to `seq_length`: tokens/s and
    TFLOP/s count the tokens the model ran on (recorded here batch by batch), read back from
    TensorBoard."""
    from megatron_bridge.models.param_count import flops_per_token
    from megatron_bridge.training.config import FinetuningDatasetConfig, LoggerConfig, TrainingConfig, ValidationConfig
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.loggers.readback import read_tensorboard
    from megatron_bridge.training.pretrain import pretrain
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    data = tmp_path / "chat"
    data.mkdir()
    write_jsonl(data / "training.jsonl", chat_rows(40, seed=0))
    shapes = []

    def recording_step(state, data_iterator, model, return_schedule_plan=False):
        batch = next(data_iterator)
        shapes.append(tuple(batch["tokens"].shape))
        return forward_step(state, iter([batch]), model)

    cfg = tiny_config(
        model=tiny_model(seq_length=128),
        train=TrainingConfig(train_iters=3, global_batch_size=4, micro_batch_size=2),
        dataset=FinetuningDatasetConfig(dataset_root=str(data), seq_length=128, num_workers=0, do_validation=False),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        logger=LoggerConfig(log_interval=1, tensorboard_dir=str(tmp_path / "tb"), log_throughput=True),
    )
    pretrain(cfg, recording_step)
    assert len(shapes) == 6  # 3 steps of 2 micro batches
    series = read_tensorboard(str(tmp_path / "tb")).series
    for step in range(3):
        ran = shapes[2 * step : 2 * step + 2]
        tokens = sum(rows * length for rows, length in ran)
        assert tokens < 4 * 128  # padded to the longest sample: the nominal count would be wrong
        seconds = series["iteration-time"].values[step]
        assert series["tokens-per-second"].values[step] * seconds == pytest.approx(tokens, rel=1e-5)
        flops = sum(flops_per_token(cfg.model, length, cfg.model.vocab_size) * length * rows for rows, length in ran)
        assert series["tflops-per-device"].values[step] * 1e12 * seconds == pytest.approx(flops, rel=1e-5)
