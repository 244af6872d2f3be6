"""The prompt tokens a worker will compute for an OpenAI request, and their block hashes.

The router loads the model's tokenizer and chat template (torch-free) and renders a
request exactly as the worker does (:mod:`kvserve.worker.openai_api`): chat messages as
``{"role", "content"}`` with the text parts joined, through the template with the
generation prompt; a completion prompt encoded with the tokenizer's special tokens, or
taken as token ids. The hashes are then the engine's own chain over the model's
namespace, so the router's view of every worker's cache is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from kvserve.core.hashing import block_hashes, make_namespace
from kvserve.engine.chat_template import ChatTemplateError
from kvserve.engine.model_config import ModelLoadError
from kvserve.engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    num_tokens: int
    reusable_hashes: list[int]  # full blocks before the last token: what a worker can match


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


class PromptHasher:
    """One model's tokenizer, turning request bodies into reusable block hashes."""

    def __init__(self, tokenizer_dir: str | Path) -> None:
        self.tokenizer = Tokenizer(tokenizer_dir)

    @classmethod
    def load(cls, tokenizer_dir: str | Path) -> PromptHasher | None:
        """None when the folder holds no readable tokenizer (kv_aware then routes by load)."""
        try:
            return cls(tokenizer_dir)
        except (ModelLoadError, OSError):
            return None

    def prompt_tokens(self, body: Mapping[str, Any]) -> list[int] | None:
        """The worker's prompt tokens, or None for a body the worker would refuse."""
        messages = body.get("messages")
        try:
            if isinstance(messages, list):
                chat = [
                    {"role": m.get("role"), "content": _message_text(m.get("content"))}
                    for m in messages
                    if isinstance(m, dict)
                ]
                return self.tokenizer.encode_chat(chat)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
        except (ChatTemplateError, jinja2.TemplateError):
            return None
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return None

    def blocks(self, body: Mapping[str, Any], block_size: int) -> PromptBlocks | None:
        tokens = self.prompt_tokens(body)
        if not tokens:
            return None
        model = body.get("model")
        namespace = make_namespace(model if isinstance(model, str) else "")
        reusable = tokens[: (len(tokens) - 1) // block_size * block_size]
        return PromptBlocks(len(tokens), block_hashes(reusable, block_size, namespace))
