"""What every storage backend offers: longest stored prefix, batched get and put.

Keys are block hashes. They are chained (each encodes its whole prefix, DESIGN.md §2),
so a prompt's blocks are usable only as a prefix, and :meth:`KVStorage.exists` answers
the one question a lookup asks: how many leading blocks are stored. Every backend keeps
its keys under a namespace naming the model and the KV layout, so a worker never reads
bytes made for another layout, even when workers of different models share one store.

Values are opaque bytes to a backend (:mod:`kvserve.engine.storage.block_codec` frames
and checks them). A backend failure (unreachable server, full disk, unreadable file)
raises :class:`StorageError`; callers treat it as a miss and recompute.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

DEFAULT_FILE_STORAGE_BYTES = 8 << 30


class StorageError(Exception):
    """The backend could not answer: the caller recomputes instead."""


class KVStorage(ABC):
    """A key-value store of encoded KV blocks under one namespace."""

    namespace: str

    @abstractmethod
    def exists(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are stored."""

    @abstractmethod
    def get_many(self, keys: Sequence[int]) -> list[bytes | None]:
        """The values of ``keys`` (``None`` for a key not stored)."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[int, bytes]]) -> list[int]:
        """Store ``items`` (a chain, root first); returns the keys evicted to make room."""

    @abstractmethod
    def delete_many(self, keys: Sequence[int]) -> None:
        """Remove ``keys`` (missing ones are ignored): a value found corrupt goes."""

    def get(self, key: int) -> bytes | None:
        return self.get_many([key])[0]

    def put(self, key: int, value: bytes) -> list[int]:
        return self.put_many([(key, value)])

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release connections or handles."""


def open_storage(
    spec: str, namespace: str, *, max_bytes: int = DEFAULT_FILE_STORAGE_BYTES
) -> KVStorage:
    """The backend named by ``spec``: ``file:DIR`` or ``redis://host:port[/db]``.

    ``max_bytes`` bounds the file backend (Redis is bounded by its own ``maxmemory``).
    """
    if spec.startswith("file:"):
        from kvserve.engine.storage.file_backend import FileStorage

        directory = spec.removeprefix("file:")
        if not directory:
            raise ValueError("file storage needs a directory: file:DIR")
        return FileStorage(Path(directory), namespace, max_bytes=max_bytes)
    if spec.startswith("redis://"):
        from kvserve.engine.storage.redis_backend import RedisStorage

        return RedisStorage(spec, namespace)
    raise ValueError(f"unknown KV storage {spec!r}: use file:DIR or redis://host:port")
