"""The storage tier on a Redis server that workers share (``redis://host:port[/db]``).

One Redis string per block, under ``kvserve:<namespace>:<key as hex>``. A lookup of a
chain is one pipelined round trip (``EXISTS`` per key), a load one ``MGET``, a write one
pipeline of ``SET``. Redis bounds its own memory: run it with ``maxmemory`` and an LRU
policy (``allkeys-lru``) to keep the tier bounded. Short socket timeouts make a dead
server cost a request one failed round trip, not a stall: the worker recomputes, and
redis-py reconnects on the next call once the server is back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import redis

from kvserve.engine.storage.base import KVStorage, StorageError

_TIMEOUT_S = 1.0


class RedisStorage(KVStorage):
    def __init__(self, url: str, namespace: str) -> None:
        self.namespace = namespace
        self._prefix = f"kvserve:{namespace}:"
        self._client = redis.Redis.from_url(
            url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S
        )

    def _name(self, key: int) -> str:
        return f"{self._prefix}{key:016x}"

    def exists(self, keys: Sequence[int]) -> int:
        if not keys:
            return 0
        try:
            pipeline = self._client.pipeline(transaction=False)
            for key in keys:
                pipeline.exists(self._name(key))
            found = pipeline.execute()
        except redis.RedisError as error:
            raise StorageError(f"redis exists: {error}") from error
        for i, count in enumerate(found):
            if not count:
                return i
        return len(keys)

    def get_many(self, keys: Sequence[int]) -> list[bytes | None]:
        if not keys:
            return []
        try:
            values = self._client.mget([self._name(key) for key in keys])
            # Bytes: the client does not decode responses (redis-py's types cannot say so).
            return cast("list[bytes | None]", values)
        except redis.RedisError as error:
            raise StorageError(f"redis get: {error}") from error

    def put_many(self, items: Sequence[tuple[int, bytes]]) -> list[int]:
        if not items:
            return []
        try:
            pipeline = self._client.pipeline(transaction=False)
            for key, value in items:
                pipeline.set(self._name(key), value)
            pipeline.execute()
        except redis.RedisError as error:
            raise StorageError(f"redis put: {error}") from error
        return []

    def delete_many(self, keys: Sequence[int]) -> None:
        if not keys:
            return
        try:
            self._client.delete(*(self._name(key) for key in keys))
        except redis.RedisError as error:
            raise StorageError(f"redis delete: {error}") from error

    def close(self) -> None:
        self._client.close()
