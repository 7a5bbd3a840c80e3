"""Prompts: read from a JSONL file, rendered with the chat template when asked, and tokenized.

A prompt is a string, or a conversation (a list of `{"role", "content"}` messages, which is
always rendered with the chat template). A prompts file has one per line: `{"prompt": "..."}`,
`{"messages": [...]}` or a JSON string.
"""

from __future__ import annotations

from typing import Any, Union

from megatron_bridge.config.paths import file_kind
from megatron_bridge.inference.errors import PromptError, json_lines
from megatron_bridge.data.chat import ChatFormatError, ChatRenderer, check_messages
from megatron_bridge.runtime.tokenizers.tokenizer import NotTokenIdsError

Prompt = Union[str, list]


def read_prompts(path: str) -> list[Prompt]:
    """The prompts of a JSONL file (or a pipe), in order; a bad line is an error naming it."""
    kind = file_kind(path)
    if kind not in ("a regular file", "a FIFO (named pipe)"):
        what = "does not exist" if kind == "missing" else f"is {kind}, not a file of prompts"
        raise PromptError(f"--prompts {path!r} {what} (give a JSONL file, one prompt per line)")
    prompts: list[Prompt] = []
    try:
        for where, row in json_lines(path, PromptError):
            if isinstance(row, dict) and "messages" in row:
                row = row["messages"]
            elif isinstance(row, dict) and "prompt" in row:
                row = row["prompt"]
            elif isinstance(row, dict):
                raise PromptError(f'{where}: expected {{"prompt": ...}} or {{"messages": [...]}}, found keys {sorted(row)}')
            prompts.append(check_prompt(row, where))
    except OSError as exc:
        raise PromptError(f"--prompts {path!r}: {exc.strerror or exc}") from None
    if not prompts:
        raise PromptError(f"--prompts {path!r} holds no prompts")
    return prompts


def check_prompt(prompt: Any, where: str) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        problem = check_messages(prompt + [{"role": "assistant", "content": ""}], where)
        if problem:
            raise PromptError(problem)
        return prompt
    raise PromptError(f"{where}: a prompt is a string or a list of messages, not {type(prompt).__name__}")


def encode_prompts(tokenizer: Any, prompts: list[Prompt], chat: bool, seq_length: int, describe: str) -> list[list[int]]:
    """Token ids of each prompt: a conversation (or any prompt with `chat`) rendered with the
    tokenizer's chat template, plain text with the tokenizer's default encoding. A prompt that
    leaves no room for a new token in the model's `seq_length` is an error."""
    renderer = None
    if chat or any(isinstance(p, list) for p in prompts):
        renderer = chat_renderer(tokenizer, describe)
    encoded = []
    for i, prompt in enumerate(prompts):
        if renderer is not None:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            try:
                text = renderer.render(messages, add_generation_prompt=True)
            except ChatFormatError as exc:
                raise PromptError(f"prompt {i + 1}: {exc}") from None
        try:  # a rendered template holds its special tokens already
            ids = tokenizer.tokenize(text) if renderer is not None else tokenizer.encode(prompt)
        except NotTokenIdsError as exc:
            raise PromptError(f"prompt {i + 1}: {exc}") from None
        if not ids:
            raise PromptError(f"prompt {i + 1} is empty (it encodes to no tokens)")
        if len(ids) >= seq_length:
            raise PromptError(
                f"prompt {i + 1} has {len(ids)} tokens, longer than the model's sequence length allows: it takes "
                f"{seq_length} tokens in all, and at least one must be left for a new token (shorten the prompt)"
            )
        encoded.append(ids)
    return encoded


def chat_renderer(tokenizer: Any, describe: str) -> Any:
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            f"the tokenizer of {describe} has no chat template, which --chat and conversation prompts need "
            "(give a tokenizer with one, e.g. --tokenizer DIR, or a plain prompt without --chat)"
        )
    try:
        return ChatRenderer(tokenizer)
    except ChatFormatError as exc:
        raise PromptError(str(exc)) from None
