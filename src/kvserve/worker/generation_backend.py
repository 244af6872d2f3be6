"""What the OpenAI routes generate with: the engine thread bridge, or a PD session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol


class OutputStream(Protocol):
    """One request's outputs in order (a ``RequestStream``, or a view of one)."""

    @property
    def finished(self) -> bool: ...
    def __aiter__(self) -> AsyncIterator[Any]: ...


class GenerationBackend(Protocol):
    """What runs generations: the engine thread bridge (``EngineBridge``), or a decode
    worker's PD session in its place."""

    engine: Any  # the LLMEngine behind it, read for its model name, context and tokenizer

    async def generate(self, request_id: str, prompt: Any, params: Any) -> OutputStream: ...
    def abort(self, request_id: str) -> None: ...
