"""The storage tier's one interface, and the table of backends that implement it.

A backend is a key-value store of encoded KV blocks under one namespace. Its contract:

- **Keys are chained block hashes.** Each encodes its whole prefix (see
  :mod:`kvserve.core.hashing`), so a prompt's blocks are usable only as a prefix:
  :meth:`KVStorage.exists` answers the one question a lookup asks, how many *leading*
  keys are stored, and a suffix whose prefix went is never served.
- **Calls are batched**: one call per chain, so a network backend makes one round trip.
- **Values are opaque bytes** (:mod:`kvserve.engine.storage.block_codec` frames and
  checks them); a value may vanish at any time (another worker's eviction): ``get_many``
  then answers ``None`` for it.
- **A fault is a miss.** A backend that cannot answer (unreachable server, full disk,
  unreadable file) raises :class:`StorageError`; callers count it and recompute.
- **Namespaces keep layouts apart**: the namespace names the model and KV layout, so a
  worker never reads bytes made for another layout, even on a store shared by models.
- Calls come from one background thread at a time for writes and one for reads.

A backend plugs in by registering an opener for its URL scheme
(:func:`register_backend`); :func:`open_storage` dispatches on the scheme.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
        """Store ``items`` (a chain, root first); returns the keys evicted to make room
        (a backend that evicts on its own, unseen, returns none)."""

    @abstractmethod
    def delete_many(self, keys: Sequence[int]) -> None:
        """Remove ``keys`` (missing ones are ignored): a value found corrupt goes."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release connections or handles."""


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """Settings a backend may use; each ignores what does not concern it."""

    max_bytes: int = DEFAULT_FILE_STORAGE_BYTES  # bound of a backend that bounds itself


# (url, namespace, options) -> backend; ValueError for a URL it cannot use.
StorageOpener = Callable[[str, str, StorageOptions], KVStorage]


@dataclass(frozen=True, slots=True)
class _Backend:
    usage: str  # the URL form, for messages: "file:DIR"
    open: StorageOpener


_BACKENDS: dict[str, _Backend] = {}


def register_backend(scheme: str, usage: str, opener: StorageOpener) -> None:
    """Make ``open_storage`` open URLs ``scheme:...`` with ``opener``."""
    if scheme in _BACKENDS:
        raise ValueError(f"a KV storage backend for {scheme!r} is already registered")
    _BACKENDS[scheme] = _Backend(usage, opener)


def _scheme(url: str) -> str:
    return url.partition(":")[0]


def is_storage_url(url: str) -> bool:
    """Whether a registered backend takes ``url`` (the command line checks early)."""
    return ":" in url and _scheme(url) in _BACKENDS


def storage_usage() -> str:
    return " | ".join(backend.usage for backend in _BACKENDS.values())


def open_storage(
    url: str, namespace: str, *, max_bytes: int = DEFAULT_FILE_STORAGE_BYTES
) -> KVStorage:
    """The backend registered for ``url``'s scheme, e.g. ``file:DIR`` or
    ``redis://host:port[/db]``. ``max_bytes`` bounds the file backend (Redis is bounded
    by its own ``maxmemory``)."""
    backend = _BACKENDS.get(_scheme(url)) if ":" in url else None
    if backend is None:
        raise ValueError(f"unknown KV storage {url!r}: use {storage_usage()}")
    return backend.open(url, namespace, StorageOptions(max_bytes=max_bytes))
