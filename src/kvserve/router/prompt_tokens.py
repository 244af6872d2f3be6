"""The prompt tokens a worker will compute for an OpenAI request, and their block hashes.

The router loads the model's tokenizer and chat template (torch-free) and renders a
request exactly as the worker does (:mod:`kvserve.worker.openai_api`): chat messages and
tools as :mod:`kvserve.model_folder.chat_request` gives them to the template, with the
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
from kvserve.core.routing.types import PromptBlocks
from kvserve.model_folder.chat_request import template_message, template_tools
from kvserve.model_folder.chat_template import ChatTemplateError
from kvserve.model_folder.errors import ModelLoadError
from kvserve.model_folder.tokenizer import Tokenizer
from kvserve.router.route_query import completion_prompts

# Prompts up to this many characters are encoded on the event loop: 2,000 characters
# (1,300 tokens) take 0.44 ms there against 0.54 ms through the tokenizer's threads on
# an idle 2-core box, and the hand-off to those threads and back waits for a CPU twice
# on a loaded one (the router then ran 7 threads instead of 13 and spent 2.85 instead of
# 3.05 ms of CPU per request beside two busy vLLM servers). Longer prompts, whose
# encoding would stall every other request on the loop, still go to those threads.
SYNC_ENCODE_MAX_CHARS = 8_192


@dataclass(frozen=True, slots=True)
class _PromptText:
    """A prompt still to encode: rendered chat text carries its own special tokens, a
    completion prompt gets the tokenizer's (BOS) added."""

    text: str
    add_special_tokens: bool


class PromptHasher:
    """One model's tokenizer, turning request bodies into reusable block hashes.

    Rendering a chat template is cheap and stays synchronous; encoding a long prompt is
    not, so the router awaits ``blocks_async`` and ``blocks`` serves offline callers.
    """

    def __init__(self, tokenizer_dir: str | Path) -> None:
        self.tokenizer = Tokenizer(tokenizer_dir)

    @classmethod
    def load(cls, tokenizer_dir: str | Path) -> PromptHasher | None:
        """None when the folder holds no readable tokenizer (kv_aware then routes by load)."""
        try:
            return cls(tokenizer_dir)
        except (ModelLoadError, OSError):
            return None

    def _prompt(self, body: Mapping[str, Any]) -> _PromptText | list[int] | None:
        """The text to encode or the token ids given, None for a body the worker refuses."""
        messages = body.get("messages")
        try:
            if isinstance(messages, list):
                chat = [template_message(m) for m in messages if isinstance(m, dict)]
                text = self.tokenizer.apply_chat_template(
                    chat, tools=template_tools(body.get("tools"))
                )
                return _PromptText(text, False)
        except (ChatTemplateError, jinja2.TemplateError):
            return None
        prompts = completion_prompts(body)  # a list of prompts is routed on its first
        prompt = prompts[0] if prompts else None
        if isinstance(prompt, str):
            return _PromptText(prompt, True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        return None

    def prompt_tokens(self, body: Mapping[str, Any]) -> list[int] | None:
        """The worker's prompt tokens, or None for a body the worker would refuse."""
        prompt = self._prompt(body)
        if isinstance(prompt, _PromptText):
            return self.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
        return prompt

    async def prompt_tokens_async(self, body: Mapping[str, Any]) -> list[int] | None:
        """``prompt_tokens`` without holding the event loop while a long prompt is encoded."""
        prompt = self._prompt(body)
        if isinstance(prompt, _PromptText) and len(prompt.text) <= SYNC_ENCODE_MAX_CHARS:
            return self.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
        if isinstance(prompt, _PromptText):
            return await self.tokenizer.encode_async(
                prompt.text, add_special_tokens=prompt.add_special_tokens
            )
        return prompt

    def blocks(self, body: Mapping[str, Any], block_size: int) -> PromptBlocks | None:
        return prompt_blocks(body, self.prompt_tokens(body), block_size)

    async def blocks_async(self, body: Mapping[str, Any], block_size: int) -> PromptBlocks | None:
        return prompt_blocks(body, await self.prompt_tokens_async(body), block_size)


def prompt_blocks(
    body: Mapping[str, Any], tokens: list[int] | None, block_size: int
) -> PromptBlocks | None:
    """The reusable block hashes of a body's prompt tokens, in its model's namespace.

    A ``cache_salt`` (vLLM's field: tenants that must not share cached prefixes) joins
    the namespace, as it does in a kvserve engine's block hashes (and as vLLM's engine
    puts it in its first block's hash, which :mod:`kvserve.core.routing.foreign_blocks`
    maps to the same namespace); an empty salt is no salt, as on both engines."""
    if not tokens:
        return None
    model, salt = body.get("model"), body.get("cache_salt")
    namespace = make_namespace(
        model if isinstance(model, str) else "", None, salt if isinstance(salt, str) else None
    )
    reusable = tokens[: (len(tokens) - 1) // block_size * block_size]
    return PromptBlocks(len(tokens), block_hashes(reusable, block_size, namespace), block_size)
