"""Test text and tokenizers trained on it (BPE, saved to a temp directory): no downloads."""

from __future__ import annotations

import json
import os
import random

SUBJECTS = ["the cat", "a dog", "my sister", "the old man", "our teacher", "the small bird", "a farmer", "the robot"]
VERBS = ["sees", "likes", "finds", "paints", "follows", "carries", "builds", "remembers"]
OBJECTS = ["the red ball", "a green house", "the river", "an apple", "the blue door", "a quiet song", "the map", "a wooden box"]
PLACES = ["in the garden", "near the station", "at night", "after lunch", "on the hill", "by the sea"]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML-style template (the one the chat tests render with)."""

QWEN3 = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{#- The last real user query; tool results come back as user turns wrapped in <tool_response>. #}
{%- set ns = namespace(last_query=messages|length - 1, searching=true) %}
{%- for i in range(messages|length - 1, -1, -1) %}
    {%- set m = messages[i] %}
    {%- if ns.searching and m.role == 'user' and m.content is string
          and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) %}
        {%- set ns.last_query = i %}
        {%- set ns.searching = false %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- set content = m.content if m.content is string else '' %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if m.reasoning_content is string %}
            {%- set reasoning = m.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {#- Reasoning is shown only after the last user query: earlier turns lose it. #}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for call in (m.tool_calls or []) %}
            {%- set f = call.function if call.function else call %}
            {%- if content or not loop.first %}{{- '\\n' }}{%- endif %}
            {{- '<tool_call>\\n{"name": "' + f.name + '", "arguments": ' }}
            {{- f.arguments if f.arguments is string else f.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
"""A chat template that renders as Qwen3's own (ChatML turns; an assistant turn after the last
user query shows its reasoning in <think>...</think>, the last one an empty block if it has none;
earlier assistant turns lose their reasoning; tool calls and tool responses; `enable_thinking`)."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.5:
        s += f" {rng.choice(PLACES)}"
    return s[0].upper() + s[1:] + "."


def document(rng: random.Random, sentences: tuple[int, int] = (2, 8)) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(*sentences)))


def documents(n: int, seed: int = 0, sentences: tuple[int, int] = (2, 8)) -> list[str]:
    rng = random.Random(seed)
    return [document(rng, sentences) for _ in range(n)]


def write_jsonl(path, rows) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def train_tokenizer(directory, vocab_size: int = 300, texts=None, chat_template: str | None = None) -> str:
    """A byte-level BPE tokenizer trained on test text, saved as tokenizer.json (+ its
    tokenizer_config.json naming eos/pad and the chat template) in `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(directory, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = texts if texts is not None else documents(400, seed=123) + ["user assistant system question answer"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    settings = {"eos_token": "<|endoftext|>", "pad_token": "<pad>"}
    if chat_template:
        settings["chat_template"] = chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f)
    return str(directory)
