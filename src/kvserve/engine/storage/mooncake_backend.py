"""The storage tier on a Mooncake Store (``mooncake://MASTER_HOST:PORT[?options]``).

Mooncake's master places each value in the memory segments that clients lend it
(``mooncake_client`` processes, or workers given ``segment=``) and the transfer engine
moves the bytes (RDMA where the cluster has it, TCP elsewhere). One object per block,
named ``kvserve/<namespace>/<key as hex>``; a lookup is one ``batch_is_exist``, a load
one ``get_batch``, a write one ``put_batch``.

The client answers with status codes, never exceptions, and some answers are ambiguous:
``get`` returns ``b""`` for a missing key and for a failure alike, and error codes are
negative integers (truthy). So every code is checked: not found is a miss, already
stored is success (another worker wrote the same block), anything else is a fault,
raised as :class:`StorageError` (counted by the caller, who recomputes). A dead master
makes calls hang for seconds: :class:`BoundedCalls` cuts them at the configured timeout
and keeps the tier off for a moment after a fault. The client is set up lazily on those
calls (first when the tier opens), so a worker starts while the master is away and
joins it when it comes back.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

from mooncake.store import MooncakeDistributedStore

from kvserve.engine.storage.base import KVStorage, StorageError
from kvserve.engine.storage.bounded_calls import BoundedCalls
from kvserve.engine.storage.mooncake_url import MooncakeStoreConfig

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that are not faults.
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
NO_AVAILABLE_HANDLE = -200  # no segment has room: the put is refused


class MooncakeStorage(KVStorage):
    def __init__(self, config: MooncakeStoreConfig, namespace: str) -> None:
        self.namespace = namespace
        self._config = config
        self._prefix = f"kvserve/{namespace}/"
        self._calls = BoundedCalls(
            "kvserve-mooncake", timeout_s=config.timeout_s, retry_s=config.retry_s
        )
        self._setup_lock = threading.Lock()
        self._store: Any = None  # the MooncakeDistributedStore once set up
        # Set up now, off the first request's path; a master away now is retried later.
        with contextlib.suppress(StorageError):
            self._calls.call("mooncake setup", self._client)

    def _client(self) -> Any:
        """The set-up client; the first call (or the first after a failed setup) makes it."""
        with self._setup_lock:
            if self._store is None:
                store = MooncakeDistributedStore()
                code = store.setup(
                    self._config.host,
                    self._config.metadata,
                    self._config.segment_bytes,
                    self._config.buffer_bytes,
                    self._config.protocol,
                    self._config.device,
                    self._config.master,
                )
                if code != 0:
                    raise StorageError(f"mooncake setup with {self._config.master}: code {code}")
                self._store = store
            return self._store

    def _fault(self, what: str, code: int) -> StorageError:
        """A failure code: the store is unwell, so the tier stays off for a moment."""
        self._calls.trip()
        return StorageError(f"mooncake {what}: code {code}")

    def _names(self, keys: Sequence[int]) -> list[str]:
        return [f"{self._prefix}{key:016x}" for key in keys]

    def exists(self, keys: Sequence[int]) -> int:
        if not keys:
            return 0
        names = self._names(keys)
        codes: list[int] = self._calls.call(
            "mooncake exists", lambda: self._client().batch_is_exist(names)
        )
        for i, code in enumerate(codes):
            if code == 0:
                return i
            if code != 1:
                raise self._fault("exists", code)
        return len(keys)

    def get_many(self, keys: Sequence[int]) -> list[bytes | None]:
        if not keys:
            return []
        names = self._names(keys)
        values: list[bytes] = self._calls.call(
            "mooncake get", lambda: self._client().get_batch(names)
        )
        empty = [name for name, value in zip(names, values, strict=True) if not value]
        if empty:  # b"" is a miss or a failure: ask which (no stored block is empty)
            codes: list[int] = self._calls.call(
                "mooncake get", lambda: self._client().batch_is_exist(empty)
            )
            failed = [code for code in codes if code != 0]
            if failed:
                raise self._fault("get", failed[0])
        return [value or None for value in values]

    def put_many(self, items: Sequence[tuple[int, bytes]]) -> list[int]:
        if not items:
            return []
        names = self._names([key for key, _ in items])
        values = [value for _, value in items]
        code: int = self._calls.call(
            "mooncake put", lambda: self._client().put_batch(names, values)
        )
        if code == NO_AVAILABLE_HANDLE:
            raise StorageError("mooncake put refused: no segment has room")
        if code not in (0, OBJECT_ALREADY_EXISTS):
            raise self._fault("put", code)
        return []

    def delete_many(self, keys: Sequence[int]) -> None:
        if not keys:
            return
        names = self._names(keys)
        # force: a value just read is leased for a moment, and a corrupt one must go now.
        codes: list[int] = self._calls.call(
            "mooncake delete", lambda: self._client().batch_remove(names, True)
        )
        failed = [code for code in codes if code not in (0, OBJECT_NOT_FOUND)]
        if failed:
            raise self._fault("delete", failed[0])

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            with contextlib.suppress(StorageError):  # a dead master: nothing to release
                self._calls.call("mooncake close", store.close)
        self._calls.close()
