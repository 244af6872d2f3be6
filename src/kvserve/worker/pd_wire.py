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

A prefill frame may offer where the bytes go instead (``"shm"``: a same-host segment,
:mod:`kvserve.worker.shm_landing`; ``"mooncake"``: a registered buffer); a ``blocks``
frame whose bytes were put there says ``"placed": true`` and has no payload.

Either side closing the connection cancels the transfer.

Both sides speak it on blocking sockets (:mod:`kvserve.worker.blocking_socket`): a
payload is written from the blocks' own memory and read straight into the tensor that
keeps it, so Python copies no KV byte; the kernel copies each once in and once out.
"""

from __future__ import annotations

import socket
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


def send_frame(sock: socket.socket, header: dict[str, Any], *payloads: memoryview) -> None:
    """One frame whose payload is ``payloads`` one after the other, each written from its
    own memory (``MSG_MORE`` joins the small prefix and the parts into full segments)."""
    parts = [payload for payload in payloads if payload.nbytes]
    if not parts:
        sock.sendall(frame_prefix(header))
        return
    sock.sendall(frame_prefix(header, sum(part.nbytes for part in parts)), socket.MSG_MORE)
    for part in parts[:-1]:
        sock.sendall(part, socket.MSG_MORE)
    sock.sendall(parts[-1])


def recv_frame_head(sock: socket.socket) -> tuple[dict[str, Any], int]:
    """The next frame's header and payload length; the caller reads the payload
    (:func:`recv_into`). ``ConnectionError`` if the peer hung up."""
    prefix = bytearray(_PREFIX.size)
    recv_into(sock, memoryview(prefix))
    magic, header_len, payload_len = _PREFIX.unpack(prefix)
    if magic != _MAGIC or header_len > MAX_HEADER_BYTES or payload_len > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"bad frame prefix {bytes(magic)!r} {header_len} {payload_len}")
    encoded = bytearray(header_len)
    recv_into(sock, memoryview(encoded))
    try:
        header = orjson.loads(encoded)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"bad frame header: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError(f"frame header without a type: {header!r}")
    return header, payload_len


def recv_into(sock: socket.socket, target: memoryview) -> None:
    """Fill ``target`` from the socket: one system call unless a signal cuts it short."""
    target = target.cast("B")
    while target.nbytes:
        received = sock.recv_into(target, target.nbytes, socket.MSG_WAITALL)
        if received == 0:
            raise ConnectionResetError("the peer closed the connection mid-frame")
        target = target[received:]
