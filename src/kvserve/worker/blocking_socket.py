"""A blocking socket worked by threads of its own, which the event loop can cut short.

Bulk KV bytes move fastest through a blocking socket: one ``sendall`` of a run's memory
and one ``recv_into`` (``MSG_WAITALL``) of the destination tensor are each a single
system call that copies in the kernel, with the GIL released and no event-loop wake-up
per chunk. So a transfer's conversation runs on a thread of its own (:meth:`run`) while
the event loop keeps the transfer's lifetime: :meth:`close` shuts the socket down, which
wakes any call blocked in it, and closes it once no thread is using it (never under a
thread's feet, where the descriptor could be reused).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class BlockingSocket:
    """Owns ``sock`` (made blocking): closed by :meth:`close` once its threads are done."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.fileno = sock.fileno()
        self._lock = threading.Lock()
        self._threads = 0
        self._closing = False

    def run(self, work: Callable[[socket.socket], T], name: str) -> asyncio.Future[T]:
        """``work(sock)`` on a new thread; its result or exception lands in the future
        (dropped if the future was cancelled meanwhile)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closing:
                raise ConnectionAbortedError("the transfer connection is closed")
            self._threads += 1

        def main() -> None:
            try:
                outcome: tuple[Any, ...] = (future.set_result, work(self.sock))
            except BaseException as exc:  # handed to the awaiting task
                outcome = (future.set_exception, exc)
            finally:
                self._thread_done()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, *outcome)

        threading.Thread(target=main, name=name, daemon=True).start()
        return future

    def close(self) -> None:
        """Shut the socket down (a blocked call returns at once) and close it as soon as
        no thread uses it. Idempotent; the peer sees the connection end."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            with contextlib.suppress(OSError):  # never connected, or the peer reset it
                self.sock.shutdown(socket.SHUT_RDWR)
            if self._threads == 0:
                self.sock.close()

    def _thread_done(self) -> None:
        with self._lock:
            self._threads -= 1
            if self._closing and self._threads == 0:
                self.sock.close()


def _settle(future: asyncio.Future[Any], setter: Callable[[Any], None], value: Any) -> None:
    if not future.done():
        setter(value)
