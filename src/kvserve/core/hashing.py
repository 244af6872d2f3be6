"""The block hash chain shared by engine, router and simulator (docs/architecture.md,
"Block hashes").

The router predicts a worker's cache exactly only if both compute bit-identical hashes
from the same tokens, in different processes and on different machines. So the hash is
defined by bytes, not by Python objects, and uses no per-process seed.

Byte layout
-----------
``namespace`` is an arbitrary byte string; :func:`make_namespace` builds the canonical
one: ``b"kvserve/1\\x00" + model + b"\\x00" + lora + b"\\x00" + cache_salt`` (UTF-8).

- root:      ``h(-1) = xxh3_64(namespace)``
- block i:   ``h(i)  = xxh3_64(h(i-1) as 8 bytes little-endian ‖ namespace ‖ tokens_i)``
  where ``tokens_i`` are the ``block_size`` token ids of block i, each as a
  little-endian uint32.

Only full blocks are hashed: a trailing partial block has no hash and is never shared.
Hashes are unsigned 64-bit Python ints.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

_xxh3_64 = xxhash.xxh3_64_intdigest
_NEEDS_BYTESWAP = sys.byteorder != "little"
_NAMESPACE_TAG = b"kvserve/1\x00"


def make_namespace(model: str, lora: str | None = None, cache_salt: str | None = None) -> bytes:
    """Canonical namespace: anything that changes KV content must be part of it."""
    parts = (model, lora or "", cache_salt or "")
    return _NAMESPACE_TAG + b"\x00".join(p.encode("utf-8") for p in parts)


def salted(namespace: bytes, cache_salt: str | None) -> bytes:
    """A request's namespace: the engine's (made with no salt) with the request's
    ``cache_salt``, i.e. ``make_namespace(model, lora, cache_salt)``. Requests with
    different salts share no block (the salt is in the root and so in every hash of the
    chain); no salt, or an empty one, leaves the namespace as it is."""
    return namespace + cache_salt.encode("utf-8") if cache_salt else namespace


def root_hash(namespace: bytes) -> int:
    """``h(-1)``: the parent of a prompt's first block."""
    return _xxh3_64(namespace)


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as consecutive little-endian uint32 values."""
    packed = array("I", tokens)
    if _NEEDS_BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    namespace: bytes,
    parent_hash: int | None = None,
    start_block: int = 0,
) -> list[int]:
    """Hashes of every full block of ``tokens`` from block ``start_block`` on.

    ``parent_hash`` is the hash of block ``start_block - 1`` (``None`` means the root);
    passing it lets a caller extend a chain incrementally as a request grows.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start_block < 0:
        raise ValueError(f"start_block must be >= 0, got {start_block}")
    prev = root_hash(namespace) if parent_hash is None else parent_hash
    num_full = len(tokens) // block_size
    if start_block >= num_full:
        return []
    data = tokens_to_bytes(tokens[start_block * block_size : num_full * block_size])
    step = 4 * block_size
    out: list[int] = []
    append = out.append
    for offset in range(0, len(data), step):
        prev = _xxh3_64(prev.to_bytes(8, "little") + namespace + data[offset : offset + step])
        append(prev)
    return out


class HashChain:
    """A request's growing chain of full-block hashes.

    Recomputing the whole chain on every decode step would cost O(length) each time;
    this extends it by the blocks completed since the last call.
    """

    __slots__ = ("block_size", "hashes", "namespace")

    def __init__(self, namespace: bytes, block_size: int) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.hashes: list[int] = []

    def extend_to(self, tokens: Sequence[int]) -> list[int]:
        """Hash the newly completed full blocks of ``tokens``; returns all hashes."""
        done = len(self.hashes)
        if (len(tokens) // self.block_size) > done:
            parent = self.hashes[-1] if done else None
            self.hashes.extend(
                block_hashes(tokens, self.block_size, self.namespace, parent, start_block=done)
            )
        return self.hashes

    def parent_of(self, index: int) -> int:
        """Hash of block ``index - 1``, or the root hash for block 0."""
        return self.hashes[index - 1] if index > 0 else root_hash(self.namespace)
