"""vLLM's KV event wire format, both ways: the router reads it from vLLM and SGLang
engines, a kvserve worker writes it for routers built for those engines (NVIDIA Dynamo,
llm-d, another kvserve router).

One ZMQ message per scheduler step, three frames: the topic (UTF-8), the sequence number
(8 bytes, big-endian, from 0 per publisher) and a msgpack payload
``[ts, [event, ...], data_parallel_rank]``. Each event is a map whose ``"type"`` is
``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``; a field that is None may be
left out. Block hashes are unsigned ints (the digest's last 8 bytes) or the whole digest
as bytes; a subscriber treats them as opaque names.

The replay socket (ROUTER) answers ``[b"", start_seq]`` from a DEALER with
``[b"", topic, seq, payload]`` for every buffered step from ``start_seq`` on, then
``[b"", b"", END_SEQ, b""]``. Pure bytes in, bytes out: the sockets live in the router
and the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

EngineHash = int | bytes
END_SEQ = b"\xff" * 8  # the replay's last message
MEDIUM_OF_TIER = {"device": "GPU", "host": "CPU"}  # vLLM's names for cache tiers
TIER_OF_MEDIUM = {"GPU": "device", "CPU": "host"}  # any other medium: storage


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A chain of full blocks entered the cache; ``parent_block_hash`` is None at a
    prompt's start. ``token_ids`` holds ``block_size`` tokens per block. ``extra_keys``
    (per block, None or a list) carries what else changed the hash, e.g. a cache salt."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = "GPU"
    extra_keys: tuple[Any, ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One publisher message: a scheduler step's events."""

    ts: float
    events: tuple[VllmEvent, ...] = field(default_factory=tuple)
    data_parallel_rank: int = 0


class WireFormatError(ValueError):
    """A message that is not in vLLM's KV event format."""


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=False)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireFormatError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=False)


def _hash(value: Any) -> EngineHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise WireFormatError(f"block hash {value!r} is neither an int nor bytes")
    return value


# SGLang's publisher encodes each event as an array: its type, then its fields in this order.
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


def _as_map(raw: Any) -> dict[str, Any]:
    """An event as vLLM's map, or SGLang's ``[type, field, ...]`` array made into one."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, list) and raw and raw[0] in _ARRAY_FIELDS:
        return {"type": raw[0], **dict(zip(_ARRAY_FIELDS[raw[0]], raw[1:], strict=False))}
    raise WireFormatError(f"event {raw!r} is neither a map nor a tagged array")


def _event(encoded: Any) -> VllmEvent:
    raw = _as_map(encoded)
    kind = raw.get("type")
    try:
        if kind == "BlockStored":
            parent = raw.get("parent_block_hash")
            extra = raw.get("extra_keys")
            return BlockStored(
                tuple(_hash(h) for h in raw["block_hashes"]),
                None if parent is None else _hash(parent),
                tuple(int(t) for t in raw["token_ids"]),
                int(raw["block_size"]),
                raw.get("lora_name"),
                raw.get("medium"),
                None if extra is None else tuple(extra),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(tuple(_hash(h) for h in raw["block_hashes"]), raw.get("medium"))
    except (KeyError, TypeError) as error:
        raise WireFormatError(f"malformed {kind} event: {error}") from error
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise WireFormatError(f"unknown event type {kind!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """A message's payload frame; :class:`WireFormatError` for anything else. Events of
    unknown types are an error too: skipping one would leave the index silently wrong.
    SGLang's batches may lack the rank (``[ts, events]``)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise WireFormatError(f"payload is not msgpack: {error}") from error
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise WireFormatError("payload is not [ts, events, rank]")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else 0
    return EventBatch(float(raw[0]), tuple(_event(e) for e in raw[1]), rank)


def _event_map(event: VllmEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": event.lora_name,
            "extra_keys": None if event.extra_keys is None else list(event.extra_keys),
        }
    if isinstance(event, BlockRemoved):
        hashes = list(event.block_hashes)
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    return bytes(
        msgpack.packb([batch.ts, [_event_map(e) for e in batch.events], batch.data_parallel_rank])
    )


def message(topic: str, seq: int, batch: EventBatch) -> list[bytes]:
    """The three frames of one published step."""
    return [topic.encode("utf-8"), encode_seq(seq), encode_batch(batch)]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to the replay socket."""
    return [b"", encode_seq(start_seq)]


def stored_tier(medium: str | None) -> str:
    """kvserve's tier for vLLM's medium (None: the GPU)."""
    return TIER_OF_MEDIUM.get(medium or "GPU", "storage")


def block_count_ok(event: BlockStored) -> bool:
    """Whether the event carries ``block_size`` tokens for each of its blocks."""
    expected = len(event.block_hashes) * event.block_size
    return event.block_size > 0 and len(event.token_ids) == expected
