"""Calls into a client library that may block far longer than a worker can wait.

A network client whose server died can hang a call for seconds (Mooncake's does, about
4.5 s per call). The storage threads must stay responsive: a request waiting for a
lookup waits on them. :class:`BoundedCalls` runs each call on its own small pool and
waits at most ``timeout_s``; a call that times out or fails opens the breaker for
``retry_s``, during which calls fail at once instead of piling up behind a dead server.
At most ``max_stuck`` calls may still be running after their deadline: past that,
calls fail at once too, so nothing grows without bound while the server is away.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from kvserve.engine.storage.base import StorageError

T = TypeVar("T")


class BoundedCalls:
    def __init__(self, name: str, *, timeout_s: float, retry_s: float, max_stuck: int = 2) -> None:
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._max_running = max_stuck + 2  # the writer's and the loader's live calls
        self._pool = ThreadPoolExecutor(self._max_running, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._running = 0
        self._closed_until = 0.0

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, or :class:`StorageError` if it raised, timed out, or may not run now."""
        with self._lock:
            if time.monotonic() < self._closed_until:
                raise StorageError(f"{what}: store unavailable, retrying later")
            if self._running >= self._max_running:
                raise StorageError(f"{what}: earlier calls are still stuck")
            self._running += 1
        future = self._pool.submit(fn)
        future.add_done_callback(self._finished)
        try:
            return future.result(self._timeout_s)
        except FutureTimeout:
            self.trip()
            raise StorageError(f"{what}: no answer in {self._timeout_s:g} s") from None
        except StorageError:
            self.trip()
            raise
        except Exception as error:  # the client library's own failures
            self.trip()
            raise StorageError(f"{what}: {error}") from error

    def trip(self) -> None:
        """Fail calls at once for ``retry_s``: the store just failed."""
        with self._lock:
            self._closed_until = time.monotonic() + self._retry_s

    def _finished(self, _: object) -> None:
        with self._lock:
            self._running -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
