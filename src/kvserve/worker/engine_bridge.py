"""The bridge between the asyncio HTTP loop and the engine, which runs in its own thread.

A model step can take long; run on the event loop it would stall every connection, health
check and disconnect. So one thread owns the engine and is the only one to touch it:
requests, aborts and queries reach it as commands on a thread-safe queue, run between
steps; outputs go back to per-request asyncio queues with one ``call_soon_threadsafe``
per step. When nothing is running the thread blocks on its inbox (no polling).
Commands issued in one event-loop iteration travel as one batch, so that a burst of
requests wakes the thread once and lands in one step.

After every iteration the thread publishes an immutable :class:`EngineState` that the
loop reads without waiting (``/load``, ``/metrics`` stay cheap while a step runs).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from kvserve.worker.engine_state import EngineState

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RequestAborted(Exception):
    """The engine dropped the request (worker shutting down, or an engine fault)."""


class RequestStream:
    """One request's outputs in order; iteration ends after the finished output.

    A deque and one future to wake the reader: ``asyncio.Queue`` does the same with
    several times the bookkeeping, paid once per output.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._items: collections.deque[Any] = collections.deque()
        self._reader: asyncio.Future[None] | None = None

    def put(self, item: Any) -> None:
        self._items.append(item)
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while not self.finished:
            if not self._items:
                self._reader = asyncio.get_running_loop().create_future()
                await self._reader
            item = self._items.popleft()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


_STOP = object()


class _Inbox:
    """Hands items from the event loop to the engine thread, waking it only while it sleeps.

    The wake-up is a byte on a pipe: ``os.write`` drops the GIL for the system call. A
    lock-based wake-up (``queue.SimpleQueue``, ``Condition``) keeps the GIL in it, and on a
    busy machine the woken thread then runs at once only to wait for that GIL, stalling
    the event loop that holds it.
    """

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._sleeping = False
        self._read_fd, self._write_fd = os.pipe()

    def put(self, item: Any) -> None:
        self._items.append(item)
        if self._sleeping:
            self._sleeping = False
            os.write(self._write_fd, b"\0")

    def get(self, *, block: bool) -> Any:
        """The oldest item; None if there is none and ``block`` is false."""
        while not self._items:
            if not block:
                return None
            self._sleeping = True
            if self._items:  # put before it saw the flag: it may not write
                self._sleeping = False
                break
            os.read(self._read_fd, 64)  # a stale byte only makes this loop once more
        return self._items.popleft()

    def close(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)


class EngineBridge:
    """Runs an engine on a dedicated thread and exposes it to asyncio code."""

    def __init__(self, engine: Any, state_probe: Callable[[Any], EngineState]) -> None:
        self.engine = engine
        self._probe = state_probe
        self._inbox: _Inbox | None = None  # command batches, or _STOP; exists while started
        self._batch: list[Callable[[], None]] = []  # event-loop side: not yet handed over
        self._streams: dict[str, RequestStream] = {}  # event-loop side only
        self._active: set[str] = set()  # engine-thread side only
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events_signal: asyncio.Event | None = None
        self.state = state_probe(engine)

    # ---- event-loop side -------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._events_signal = asyncio.Event()
        self._inbox = _Inbox()
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread.is_alive()

    async def shutdown(self) -> None:
        """Aborts whatever is still running, then stops and joins the engine thread."""
        inbox = self._inbox
        if inbox is None:
            return
        if self._thread.is_alive():
            self._flush()
            inbox.put(_STOP)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._inbox = None
        inbox.close()
        for stream in self._streams.values():
            stream.put(RequestAborted("worker shut down"))
        self._streams.clear()

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between steps and returns its result."""
        loop = self._require_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._submit(run)
        return await future

    def post(self, fn: Callable[[Any], None]) -> None:
        """Runs ``fn(engine)`` on the engine thread between steps, without waiting: for
        cleanups that must happen even when the caller is being cancelled."""
        self._submit(lambda: fn(self.engine))

    async def generate(self, request_id: str, prompt: Any, params: Any) -> RequestStream:
        """Adds a request; raises what ``add_request`` raises (e.g. InvalidRequestError)."""
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        try:
            await self.call(lambda engine: self._add(engine, request_id, prompt, params))
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except Exception:
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Drops the request now; its blocks are freed before the engine's next step."""
        self._streams.pop(request_id, None)
        self._submit(lambda: self._abort(request_id))

    async def wait_for_events(self, after_seq: int, timeout: float) -> None:
        """Returns once an event past ``after_seq`` exists, or after ``timeout`` seconds."""
        deadline = self._require_loop().time() + timeout
        while self.state.events_last_seq <= after_seq:
            remaining = deadline - self._require_loop().time()
            if remaining <= 0 or self._events_signal is None:
                return
            try:
                await asyncio.wait_for(self._events_signal.wait(), remaining)
            except TimeoutError:
                return

    def _submit(self, command: Callable[[], None]) -> None:
        """Queues ``command``; the batch goes to the engine thread once the loop has run
        what is ready now. Handing each command over at once would wake the thread for
        the first of a burst, which it would then step alone while the rest wait."""
        if not self._batch:
            self._require_loop().call_soon(self._flush)
        self._batch.append(command)

    def _flush(self) -> None:
        if self._batch and self._inbox is not None:
            self._inbox.put(self._batch)
            self._batch = []

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("EngineBridge.start() was not called")
        return self._loop

    def _complete_iteration(self, outputs: list[Any], state: EngineState) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by its client while the step ran
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]
        self._publish(state)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)

    def _publish(self, state: EngineState) -> None:
        events_moved = state.events_last_seq != self.state.events_last_seq
        self.state = state
        if events_moved and self._events_signal is not None:
            self._events_signal.set()
            self._events_signal = asyncio.Event()

    # ---- engine-thread side ----------------------------------------------------------

    def _add(self, engine: Any, request_id: str, prompt: Any, params: Any) -> None:
        engine.add_request(request_id, prompt, params)
        self._active.add(request_id)

    def _abort(self, request_id: str) -> None:
        if request_id in self._active:
            self._active.discard(request_id)
            self.engine.abort_request(request_id)

    def _run(self) -> None:
        loop = self._require_loop()
        while self._run_commands(block=not self.engine.has_unfinished_requests()):
            outputs = self._step(loop) if self.engine.has_unfinished_requests() else []
            loop.call_soon_threadsafe(self._complete_iteration, outputs, self._probe(self.engine))
        self._abort_all(loop, RequestAborted("worker shut down"))
        loop.call_soon_threadsafe(self._complete_iteration, [], self._probe(self.engine))

    def _run_commands(self, *, block: bool) -> bool:
        """Runs queued commands (waiting for one if ``block``); False once told to stop."""
        inbox = self._inbox
        assert inbox is not None, "closed only after this thread has ended"
        batch = inbox.get(block=block)
        while batch is not None:
            if batch is _STOP:
                return False
            for command in batch:
                try:
                    command()
                except Exception:
                    logger.exception("engine command failed")
            batch = inbox.get(block=False)
        return True

    def _step(self, loop: asyncio.AbstractEventLoop) -> list[Any]:
        try:
            outputs: list[Any] = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; aborting its requests")
            self._abort_all(loop, RequestAborted(f"engine step failed: {exc!r}"))
            return []
        for output in outputs:
            if output.finished:
                self._active.discard(output.request_id)
        return outputs

    def _abort_all(self, loop: asyncio.AbstractEventLoop, error: Exception) -> None:
        aborted = list(self._active)
        for request_id in aborted:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
        self._active.clear()
        if aborted:
            loop.call_soon_threadsafe(self._fail, aborted, error)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return  # its waiter was cancelled
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
