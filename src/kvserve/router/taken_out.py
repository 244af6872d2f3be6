"""Attempts waiting on a worker that the router takes out are retried elsewhere.

A hung worker (stopped, deadlocked, swapping) accepts connections and never answers, so
an attempt sent to it waits until ``--request-timeout``, long after the health checks
have taken the worker out. Each attempt therefore registers itself on its worker while it
waits for the answer's headers; when the worker is taken out, those attempts are
cancelled and fail as :class:`WorkerTakenOut`, an ``aiohttp.ClientError``, which the proxy
retries on another worker like any unreachable one (nothing reached the client yet).
Once a stream starts to reach the client, the attempt disarms its watch: a stream is
never cut this way. A non-streamed answer stays watched until its body is in, since its
headers may leave the worker with the first token (``x-kvserve-first-token``) long before
the body, and nothing has reached the client until the router has the whole body.

The cancellation follows ``asyncio.timeout``'s pattern: the waiting task is cancelled and
the cancellation turned into the error on the way out, unless someone else (a client
that left) cancelled the task too, which then stays a cancellation.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

import aiohttp

from kvserve.router.worker_registry import Worker


class WorkerTakenOut(aiohttp.ClientError):
    """The worker was taken out (unhealthy) while the attempt waited for its answer."""


class AnswerWatch:
    """``with AnswerWatch(worker) as watch:`` around sending a request; call
    :meth:`disarm` once the answer starts to reach the client. (A plain ``with``: it
    never waits, and an ``async with`` cost two coroutines per request.)"""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._task: asyncio.Task[object] | None = None
        self._cancelled = False

    def __enter__(self) -> AnswerWatch:
        self._task = asyncio.current_task()
        self._worker.waiting_for_answer.add(self)
        return self

    def disarm(self) -> None:
        self._worker.waiting_for_answer.discard(self)

    def take_out(self) -> None:
        """The worker was taken out: stop waiting for it."""
        self.disarm()
        if self._task is not None and not self._cancelled:
            self._cancelled = True
            self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.disarm()
        if not self._cancelled or self._task is None:
            return
        if self._task.uncancel() == 0 and exc_type is asyncio.CancelledError:
            raise WorkerTakenOut(f"worker {self._worker.worker_id} was taken out") from None


def take_out(worker: Worker) -> int:
    """Cancel every attempt waiting for ``worker``'s answer; how many there were."""
    waiting = list(worker.waiting_for_answer)
    for watch in waiting:
        watch.take_out()
    return len(waiting)
