"""Steady closed-loop load, kept up while something else happens to the fleet.

Chaos runs and fault tests need traffic flowing *while* a worker is killed or stopped,
and then an account of every request: answered, failed, or cut off mid-stream. Each of
``clients`` connections sends one completion after another (streamed and not, in turn)
until stopped; nothing is raised, every request ends as an :class:`Outcome`. The load
runs on its own thread and event loop, so a caller can kill processes and poll servers
meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import aiohttp
import orjson

from kvserve.bench.client import WORKER_HEADER, api_base


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request ended. ``complete``: a full answer (a stream up to ``[DONE]``)."""

    started: float  # time.monotonic()
    ended: float
    streamed: bool
    status: int | None  # None: no HTTP answer at all (refused, reset, timed out)
    complete: bool
    worker: str | None  # x-kvserve-worker
    error: str | None


class SteadyLoad:
    """``clients`` concurrent requesters against an OpenAI endpoint, until :meth:`stop`."""

    def __init__(
        self,
        endpoint: str,
        *,
        model: str,
        clients: int = 4,
        max_tokens: int = 32,
        timeout_s: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._url = api_base(endpoint) + "/completions"
        self._model = model
        self._clients = clients
        self._max_tokens = max_tokens
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = headers or {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._outcomes: list[Outcome] = []
        self._in_flight: dict[int, tuple[float, bool]] = {}  # client: (started, streamed)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    def outcomes(self) -> list[Outcome]:
        """The requests ended so far."""
        with self._lock:
            return list(self._outcomes)

    def in_flight(self, *, streamed: bool) -> list[float]:
        """When the requests still waiting for their end were sent (streamed or not)."""
        with self._lock:
            return [t for t, s in self._in_flight.values() if s == streamed]

    def stop(self, timeout_s: float = 120.0) -> list[Outcome]:
        """Let each client finish its request in flight; every request's outcome."""
        self._stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"load clients still waiting after {timeout_s}s")
        return self.outcomes()

    async def _run(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, headers=self._headers) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self._clients)))

    async def _client(self, session: aiohttp.ClientSession, index: int) -> None:
        sent = 0
        while not self._stopping.is_set():
            stream = (index + sent) % 2 == 0
            with self._lock:
                self._in_flight[index] = (time.monotonic(), stream)
            outcome = await self._one(session, stream=stream, n=sent)
            with self._lock:
                del self._in_flight[index]
                self._outcomes.append(outcome)
            sent += 1

    async def _one(self, session: aiohttp.ClientSession, *, stream: bool, n: int) -> Outcome:
        body = {
            "model": self._model,
            "prompt": f"request {n}: " + "steady load " * 8,
            "max_tokens": self._max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
        started = time.monotonic()
        status: int | None = None
        worker: str | None = None
        try:
            async with session.post(self._url, data=orjson.dumps(body), timeout=self._timeout) as r:
                status, worker = r.status, r.headers.get(WORKER_HEADER)
                payload = await r.read()
            error = _stream_error(payload) if stream else None
            complete = status == 200 and error is None and (not stream or b"[DONE]" in payload)
            if status != 200:
                error = payload[:200].decode(errors="replace")
            elif not complete and error is None:
                error = "stream ended before [DONE]"
        except (aiohttp.ClientError, TimeoutError) as exc:
            complete, error = False, f"{type(exc).__name__}: {exc}"
        return Outcome(started, time.monotonic(), stream, status, complete, worker, error)


def _stream_error(payload: bytes) -> str | None:
    """The error event a stream carries (a router's ``stream_broken``), if any."""
    for line in payload.split(b"\n"):
        if line.startswith(b"data: {") and b'"error"' in line:
            return line[len(b"data: ") :].decode(errors="replace")
    return None
