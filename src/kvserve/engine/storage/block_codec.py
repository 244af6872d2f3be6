"""One KV block as a storage value: framed, checksummed, refused unless it is exactly
the block asked for in this worker's layout.

A value is ``magic | key | xxh3-64 of the rest | kv_block_io.pack(layout, block)``. The
key in the frame catches a value stored under the wrong name, the checksum catches a
file cut short or flipped bits, and :func:`kvserve.engine.kv_block_io.unpack` refuses a
foreign layout: any of these is :class:`CorruptBlock`, which the loader treats as a
miss. Nothing unchecked is ever installed in the device pool.
"""

from __future__ import annotations

import struct

import torch
import xxhash

from kvserve.engine.kv_block_io import KVBlockLayout, KVLayoutMismatch, pack, unpack

_MAGIC = b"KVS1"
_FRAME = struct.Struct("<4sQQ")  # magic, key, checksum of the packed block


class CorruptBlock(ValueError):
    """A stored value is not the block it claims to be."""


def namespace_of(layout: KVBlockLayout) -> str:
    """A short, file-name-safe name for the model and KV layout."""
    return xxhash.xxh3_64_hexdigest(layout.tag().encode())


def encode(layout: KVBlockLayout, key: int, block: torch.Tensor) -> bytes:
    """``block`` is ``[1, *layout.block_shape]``, as :func:`read_blocks` returns it."""
    packed = pack(layout, block)
    return _FRAME.pack(_MAGIC, key, xxhash.xxh3_64_intdigest(packed)) + packed


def decode(layout: KVBlockLayout, key: int, value: bytes) -> torch.Tensor:
    """The ``[1, *block_shape]`` block of a value, or :class:`CorruptBlock`."""
    if len(value) < _FRAME.size:
        raise CorruptBlock(f"value of {len(value)} bytes is shorter than its frame")
    magic, stored_key, checksum = _FRAME.unpack_from(value)
    if magic != _MAGIC or stored_key != key:
        raise CorruptBlock(f"value does not frame block {key:#x}")
    packed = memoryview(value)[_FRAME.size :]
    if xxhash.xxh3_64_intdigest(packed) != checksum:
        raise CorruptBlock(f"checksum mismatch in block {key:#x}")
    try:
        block = unpack(layout, packed)
    except KVLayoutMismatch as error:
        raise CorruptBlock(str(error)) from error
    if block.shape[0] != 1:
        raise CorruptBlock(f"value holds {block.shape[0]} blocks, not one")
    return block
