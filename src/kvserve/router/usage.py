"""Reading the worker's reported ``cached_tokens`` from responses passing through.

Streams are relayed byte for byte; this only looks at SSE lines that mention
``cached_tokens`` (the usage chunk), so the cost per chunk is a substring search.
"""

from __future__ import annotations

from typing import Any

import orjson


def cached_tokens_in(payload: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a response or chunk, if present."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None


def json_body(body: bytes) -> Any:
    """A response body parsed, or None if it is not JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def cached_tokens_in_body(body: bytes) -> int | None:
    return cached_tokens_in(json_body(body))


def is_error(payload: Any) -> bool:
    """Whether a parsed answer is an OpenAI error body rather than a completion."""
    return isinstance(payload, dict) and "error" in payload


class StreamUsageReader:
    """Finds the usage chunk in an SSE byte stream split at arbitrary points."""

    _MARKER = b"cached_tokens"

    def __init__(self) -> None:
        self._partial_line = b""
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        if self._MARKER not in chunk and not self._partial_line:
            tail = chunk.rsplit(b"\n", 1)
            self._partial_line = tail[1] if len(tail) == 2 else chunk
            return
        *lines, self._partial_line = (self._partial_line + chunk).split(b"\n")
        for line in lines:
            if self._MARKER in line and line.startswith(b"data:"):
                try:
                    found = cached_tokens_in(orjson.loads(line[5:]))
                except orjson.JSONDecodeError:
                    continue
                if found is not None:
                    self.cached_tokens = found
