"""vLLM's KV event wire format: batches kvserve encodes decode as vLLM's layout says, both
of vLLM's hash encodings are accepted, SGLang's array-encoded events and rank-less
batches decode alike, and anything else is refused rather than half applied."""

from __future__ import annotations

import msgpack
import pytest

from kvserve.core.vllm_kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireFormatError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    message,
    stored_tier,
)


def test_a_batch_is_three_frames_in_vllms_layout() -> None:
    batch = EventBatch(
        12.5,
        (
            BlockStored((1, 2), None, tuple(range(8)), 4),
            BlockRemoved((1,)),
            AllBlocksCleared(),
        ),
    )
    topic, seq, payload = message("kv", 7, batch)
    assert topic == b"kv" and seq == (7).to_bytes(8, "big")
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (12.5, 0)
    assert events[0]["type"] == "BlockStored" and next(iter(events[0])) == "type"
    assert events[0]["block_hashes"] == [1, 2] and events[0]["parent_block_hash"] is None
    assert events[0]["token_ids"] == list(range(8)) and events[0]["medium"] == "GPU"
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}
    assert decode_batch(payload) == batch


def test_digest_hashes_and_omitted_fields_are_accepted() -> None:
    digest = bytes(range(32))  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
    payload = msgpack.packb(
        [1.0, [{"type": "BlockStored", "block_hashes": [digest], "token_ids": [5] * 4,
                "block_size": 4}], 0]
    )  # fmt: skip
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (digest,) and event.parent_block_hash is None
    assert event.medium is None and stored_tier(event.medium) == "device"


def test_sglang_array_events_and_rankless_batches_decode() -> None:
    payload = msgpack.packb(
        [2.0, [["BlockStored", [9], 8, [1, 2], 2, None, "GPU"], ["BlockRemoved", [9]],
               ["AllBlocksCleared"]]]
    )  # fmt: skip
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 0
    assert batch.events == (
        BlockStored((9,), 8, (1, 2), 2, None, "GPU"),
        BlockRemoved((9,), None),
        AllBlocksCleared(),
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0, [{"type": "BlockMoved"}], 0]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}], 0]),
        msgpack.packb([1.0, [["Unknown", 1]], 0]),
    ],
)
def test_malformed_payloads_are_refused(payload: bytes) -> None:
    with pytest.raises(WireFormatError):
        decode_batch(payload)


def test_sequence_numbers_are_eight_bytes_big_endian() -> None:
    assert encode_seq(258) == b"\x00" * 6 + b"\x01\x02"
    assert decode_seq(encode_seq(2**64 - 2)) == 2**64 - 2
    with pytest.raises(WireFormatError):
        decode_seq(b"\x01")


def test_mediums_map_to_tiers() -> None:
    assert [stored_tier(m) for m in ("GPU", "CPU", "STORAGE", None)] == [
        "device",
        "host",
        "storage",
        "device",
    ]
    assert encode_batch(EventBatch(0.0)) == msgpack.packb([0.0, [], 0])
