"""Chat conversations: render `messages` with the tokenizer's chat template and mark the tokens
the loss covers (those of assistant turns).

A conversation is a list of `{"role": ..., "content": ...}` dicts. The template is rendered as
`transformers` does (a sandboxed Jinja environment with `messages`, `add_generation_prompt`,
`bos_token`, `eos_token`, `raise_exception`). An assistant turn's tokens are those its message
adds after the generation prompt: its content and end-of-turn marker, found by rendering the
conversation up to each assistant message and mapping the characters to tokens through the
tokenizer's offsets.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

ASSISTANT = "assistant"


class ChatFormatError(ValueError):
    """A conversation or template that cannot be rendered as asked."""


def check_messages(messages: Any, location: str) -> Optional[str]:
    """What is wrong with a `messages` value (None if nothing)."""
    if not isinstance(messages, list) or not messages:
        return f"{location}: 'messages' must be a non-empty list of {{role, content}} objects, got {_short(messages)}"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"{location}: messages[{i}] is {_short(message)}, not a {{role, content}} object"
        if not isinstance(message.get("role"), str) or not message.get("role"):
            return f"{location}: messages[{i}] has no 'role' (each message needs a role such as user or assistant, and its content)"
        if "content" not in message:
            return f"{location}: messages[{i}] ({message['role']}) has no 'content'"
    if not any(m["role"] == ASSISTANT for m in messages):
        return f"{location}: no message has role 'assistant', so nothing would be trained on"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> Any:
    """The Jinja template, compiled in a sandbox (templates come from data files)."""
    from megatron_bridge.extras import require

    jinja2 = require("jinja2", "chat templates")
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatFormatError(f"the chat template refuses this conversation: {message}")

    def tojson(value: Any, indent: Optional[int] = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
        import json

        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: __import__("datetime").datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatFormatError(f"the chat template is not valid Jinja: {exc.message} (line {exc.lineno})") from None


class ChatRenderer:
    """Turns conversations into token ids and the flags of assistant tokens."""

    def __init__(self, tokenizer: Any, template: Optional[str] = None):
        template = template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ChatFormatError("the tokenizer has no chat template (set tokenizer.chat_template to a Jinja template)")
        if not hasattr(tokenizer, "tokenize_with_offsets"):
            raise ChatFormatError(f"{type(tokenizer).__name__} cannot tokenize text (use a HuggingFaceTokenizer)")
        self.tokenizer = tokenizer
        self.template = compile_template(template)
        self.variables = {"bos_token": getattr(tokenizer, "bos_token", None) or "", "eos_token": getattr(tokenizer, "eos_token", None) or ""}

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.variables)

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation, and the character span of each assistant turn."""
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(prompt) and text.startswith(upto)):
                raise ChatFormatError(
                    f"the chat template does not render the conversation incrementally at messages[{i}] "
                    "(the text up to an assistant turn must be a prefix of the whole), so the assistant "
                    "tokens cannot be located; use a template without history-dependent rewriting"
                )
            spans.append((len(prompt), len(upto)))
        return text, spans

    def encode(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, flags) where flags[i] is 1 when token i belongs to an assistant turn."""
        text, spans = self.assistant_spans(messages)
        ids, offsets = self.tokenizer.tokenize_with_offsets(text)
        starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
        flags = np.zeros(len(ids), dtype=np.uint8)
        for begin, end in spans:
            flags[(starts >= begin) & (starts < end)] = 1
        return np.asarray(ids, dtype=np.int64), flags
