"""Logprobs in OpenAI's two shapes: the legacy completions one (parallel lists of token
strings, logprobs, top alternatives and text offsets) and chat's ``content`` list.

Token strings are each token decoded alone (special tokens kept), as OpenAI and vLLM
report them; a token that is part of a multi-byte character decodes to U+FFFD, and its
``bytes`` in chat are then those of that replacement, not the raw byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.engine.logprobs import TokenLogprob
from kvserve.model_folder.tokenizer import Tokenizer

# Nothing of a logprob is worth more digits than a float32 carries.
_DIGITS = 8


class TokenTexts:
    """Token id → its text, decoded once per worker."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


class LegacyLogprobs:
    """One completion choice's ``logprobs`` object, built as its tokens arrive; each
    ``take`` returns the part added since the previous one (a stream chunk's)."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self._offset = 0  # characters of the choice's text before the next token
        self._body = _legacy_body()
        self._taken = 0

    def add(self, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int]) -> None:
        """Tokens in order; None for a position with no logprob (a prompt's first token)."""
        body = self._body
        for entry, token_id in zip(entries, token_ids, strict=True):
            text = self._texts(token_id)
            body["tokens"].append(text)
            body["text_offset"].append(self._offset)
            self._offset += len(text)
            if entry is None:
                body["token_logprobs"].append(None)
                body["top_logprobs"].append(None)
                continue
            body["token_logprobs"].append(round(entry.logprob, _DIGITS))
            body["top_logprobs"].append(
                {self._texts(t): round(value, _DIGITS) for t, value in entry.top}
            )

    def whole(self) -> dict[str, Any]:
        return self._body

    def take(self) -> dict[str, Any] | None:
        """The tokens added since the last ``take``; None if there are none."""
        start, self._taken = self._taken, len(self._body["tokens"])
        if start == self._taken:
            return None
        return {key: values[start:] for key, values in self._body.items()}


def _legacy_body() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """A chat choice's (or delta's) ``logprobs``: ``{"content": [...], "refusal": null}``."""
    return {"content": [_chat_entry(e, texts) for e in entries], "refusal": None}


def _chat_entry(entry: TokenLogprob, texts: TokenTexts) -> dict[str, Any]:
    item = _chat_token(entry.token_id, entry.logprob, texts)
    item["top_logprobs"] = [_chat_token(t, value, texts) for t, value in entry.top]
    return item


def _chat_token(token_id: int, logprob: float, texts: TokenTexts) -> dict[str, Any]:
    text = texts(token_id)
    return {"token": text, "logprob": round(logprob, _DIGITS), "bytes": list(text.encode())}
