"""Frames of the KV transfer protocol between a decode worker and a prefill worker.

A frame is ``magic "KVT1" | header length (u32 LE) | payload length (u64 LE) | header |
payload``: the header is a JSON object with a ``type``; the payload is raw KV block bytes
(:mod:`kvserve.engine.kv_block_io` layout) or empty. The conversation, on one TCP
connection opened by the decode worker:

- decode -> prefill: ``{"type": "prefill", "token_ids", "first_block", "num_blocks",
  "layout"}``
- prefill -> decode: any number of ``{"type": "blocks", "first_block", "num_blocks"}``
  with their bytes, in order, then ``{"type": "done", "cached_tokens"}`` or
  ``{"type": "error", "message"}``.

Either side closing the connection cancels the transfer.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson

_MAGIC = b"KVT1"
_PREFIX = struct.Struct("<4sIQ")
MAX_HEADER_BYTES = 16 * 1024 * 1024  # a prefill frame's token ids; far above any context
MAX_PAYLOAD_BYTES = 1 << 34


class ProtocolError(RuntimeError):
    """The peer sent something that is not a frame of this protocol."""


def frame_prefix(header: dict[str, Any], payload_len: int = 0) -> bytes:
    """The bytes before a frame's payload (write the payload after them)."""
    encoded = orjson.dumps(header)
    return _PREFIX.pack(_MAGIC, len(encoded), payload_len) + encoded


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """The next frame's header and payload; ``IncompleteReadError`` if the peer hung up."""
    magic, header_len, payload_len = _PREFIX.unpack(await reader.readexactly(_PREFIX.size))
    if magic != _MAGIC or header_len > MAX_HEADER_BYTES or payload_len > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"bad frame prefix {magic!r} {header_len} {payload_len}")
    try:
        header = orjson.loads(await reader.readexactly(header_len))
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"bad frame header: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError(f"frame header without a type: {header!r}")
    payload = await reader.readexactly(payload_len) if payload_len else b""
    return header, payload
