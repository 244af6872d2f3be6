"""KV block bytes: exact round trips, refusal of foreign layouts, and installed KV that a
second runner computes on exactly as if it had computed the prefix itself."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvserve.engine.kv_block_io import (
    KVBlockLayout,
    KVLayoutMismatch,
    from_bytes,
    pack,
    read_blocks,
    to_bytes,
    unpack,
    write_blocks,
)
from kvserve.engine.kv_pool import KVPool
from kvserve.engine.model_runner import ModelRunner, SequenceBatchItem

LAYOUT = KVBlockLayout("m", num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def make_pool(layout: KVBlockLayout, num_blocks: int = 10, seed: int = 0) -> KVPool:
    pool = KVPool(
        num_layers=layout.num_layers,
        num_blocks=num_blocks,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.torch_dtype,
        device=torch.device("cpu"),
    )
    generator = torch.Generator().manual_seed(seed)
    for layer in range(layout.num_layers):
        target = pool.layer(layer)
        target.copy_(torch.randn(target.shape, generator=generator).to(target.dtype))
    return pool


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_blocks_round_trip_through_bytes_into_other_block_ids(dtype: str) -> None:
    layout = dataclasses.replace(LAYOUT, dtype=dtype)
    source, target = make_pool(layout, seed=1), make_pool(layout, seed=2)
    blocks = read_blocks(source, layout, [7, 2, 5])
    assert blocks.shape == (3, *layout.block_shape) and blocks.device.type == "cpu"
    payload = to_bytes(blocks)
    assert len(payload) == 3 * layout.block_nbytes
    write_blocks(target, layout, [0, 9, 4], from_bytes(layout, payload))
    for layer in range(layout.num_layers):
        for src, dst in ((7, 0), (2, 9), (5, 4)):
            assert torch.equal(target.layer(layer)[dst], source.layer(layer)[src])
    untouched = make_pool(layout, seed=2)
    assert torch.equal(target.layer(1)[1], untouched.layer(1)[1])


def test_block_bytes_follow_the_documented_layout() -> None:
    """Block i of a run is its own byte range; within it layer, slot, K heads then V."""
    pool = make_pool(LAYOUT)
    payload = to_bytes(read_blocks(pool, LAYOUT, [3, 6]))
    second = from_bytes(LAYOUT, payload[LAYOUT.block_nbytes :])[0]
    assert torch.equal(second[2], pool.layer(2)[6])
    assert torch.equal(second[1, :, : LAYOUT.num_kv_heads], pool.keys(1)[6])
    assert torch.equal(second[1, :, LAYOUT.num_kv_heads :], pool.values(1)[6])


def test_packed_buffer_names_its_layout_and_refuses_another() -> None:
    pool = make_pool(LAYOUT)
    blocks = read_blocks(pool, LAYOUT, [1, 2])
    packed = pack(LAYOUT, blocks)
    assert torch.equal(unpack(LAYOUT, packed), blocks)
    for change in ({"model": "other"}, {"dtype": "bfloat16"}, {"head_dim": 4}, {"byteorder": "x"}):
        with pytest.raises(KVLayoutMismatch):
            unpack(dataclasses.replace(LAYOUT, **change), packed)
    with pytest.raises(KVLayoutMismatch):
        unpack(LAYOUT, packed[:-1])
    with pytest.raises(KVLayoutMismatch):
        unpack(LAYOUT, b"XXXX" + packed[4:])
    assert KVBlockLayout.from_json(LAYOUT.to_json()).tag() == LAYOUT.tag()


def test_wrong_shapes_and_block_ids_are_refused_before_any_write() -> None:
    pool = make_pool(LAYOUT)
    before = read_blocks(pool, LAYOUT, range(10))
    with pytest.raises(KVLayoutMismatch):
        from_bytes(LAYOUT, b"\0" * (LAYOUT.block_nbytes + 4))
    with pytest.raises(KVLayoutMismatch):
        write_blocks(pool, LAYOUT, [0], torch.zeros(2, *LAYOUT.block_shape))
    with pytest.raises(IndexError):
        write_blocks(pool, LAYOUT, [0, 10], torch.zeros(2, *LAYOUT.block_shape))
    with pytest.raises(IndexError):
        read_blocks(pool, LAYOUT, [-1])
    assert torch.equal(read_blocks(pool, LAYOUT, range(10)), before)
    assert from_bytes(LAYOUT, b"").shape == (0, *LAYOUT.block_shape)


def test_installed_prefix_gives_the_same_logits_as_computing_it(tiny_model_dir: Path) -> None:
    block_size, prompt = 4, list(range(40, 53))  # 3 full blocks and one token
    first = ModelRunner(tiny_model_dir, num_blocks=8, block_size=block_size, device="cpu")
    second = ModelRunner(tiny_model_dir, num_blocks=8, block_size=block_size, device="cpu")
    layout = KVBlockLayout.of_runner(first, "tiny")
    assert layout == KVBlockLayout.of_runner(second, "tiny")
    expected = first.forward([SequenceBatchItem(prompt, 0, [5, 1, 6, 2])])
    payload = to_bytes(read_blocks(first.kv_pool, layout, [5, 1, 6]))
    write_blocks(second.kv_pool, layout, [0, 3, 7], from_bytes(layout, payload))
    logits = second.forward([SequenceBatchItem(prompt[12:], 12, [0, 3, 7, 4])])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
