"""OpenAI response bodies for text completions and chat completions.

The two APIs differ only in how a choice and a stream delta look; :class:`ResponseFormat`
captures that difference so that one generation flow serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """How one API shapes its bodies; ``chat`` selects message/delta choices."""

    chat: bool
    id_prefix: str

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object_name(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def response(
        self,
        request_id: str,
        model: str,
        created: int,
        choices: list[dict[str, Any]],
        usage_body: dict[str, Any],
    ) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": self.object_name,
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage_body,
        }

    def choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        """One whole choice of a response that is not streamed."""
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    def chunk(
        self,
        request_id: str,
        model: str,
        created: int,
        choices: list[dict[str, Any]],
    ) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": self.chunk_object_name,
            "created": created,
            "model": model,
            "choices": choices,
        }

    def delta_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        return choice

    def opening_choice(self, index: int) -> dict[str, Any] | None:
        """Chat streams announce the assistant role of each choice before its content."""
        if not self.chat:
            return None
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }


COMPLETION = ResponseFormat(chat=False, id_prefix="cmpl-")
CHAT = ResponseFormat(chat=True, id_prefix="chatcmpl-")
