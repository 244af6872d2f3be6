"""The load generator: replays a workload against an OpenAI endpoint.

Three ways to pace it: open loop at the trace's timestamps times ``time_scale``; open
loop with Poisson arrivals at ``rate``; or closed loop with ``concurrency`` users.
Open loop never waits for the server before sending the next request (a slow server
shows up as latency, not as a slower offered load); every request is bounded by the
request timeout. ``stop()`` (Ctrl-C) stops issuing, cancels what is in flight — the
connection close aborts it server-side — and ``run`` returns what completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from kvserve.bench.client import api_base, auth_headers, stream_request
from kvserve.bench.metrics import RequestRecord
from kvserve.bench.workloads import RequestSpec


@dataclass(frozen=True, slots=True)
class LoadConfig:
    endpoint: str
    model: str
    concurrency: int | None = None  # closed loop with this many users
    rate: float | None = None  # open loop, Poisson arrivals per second
    time_scale: float = 1.0  # open loop at trace timestamps × time_scale
    duration_s: float | None = None  # stop issuing after this long
    request_timeout_s: float = 300.0
    seed: int = 0
    api_key: str | None = None  # sent as a Bearer token
    ignore_eos: bool = False  # ask for exactly max_tokens (vLLM, SGLang and kvserve accept it)

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.rate is not None:
            raise ValueError("choose one of concurrency (closed loop) and rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")


class ProgressSink(Protocol):
    def record(self, record: RequestRecord) -> None: ...
    def item_done(self) -> None: ...


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    duration_s: float
    stopped_by: str  # "completed" | "duration" | "interrupted"
    abandoned: int  # requests in flight when interrupted, not counted in records
    started_at: float  # wall clock (epoch seconds), for the report


class LoadGenerator:
    def __init__(self, config: LoadConfig, progress: ProgressSink | None = None) -> None:
        self.config = config
        self.progress = progress
        self.records: list[RequestRecord] = []
        self._stop = asyncio.Event()
        self._interrupted = False
        self._cut_by_duration = False  # some request was left unsent at the deadline
        self._abandoned = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._t0 = 0.0

    def stop(self) -> None:
        """Stop issuing and cancel requests in flight; safe to call from a signal handler."""
        self._interrupted = True
        self._stop.set()
        for task in list(self._tasks):
            task.cancel()

    async def run(self, specs: Iterable[RequestSpec]) -> RunOutcome:
        started_at = time.time()
        self._t0 = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        # limit=0: open loop must never queue requests client-side.
        connector = aiohttp.TCPConnector(limit=0)
        headers = auth_headers(self.config.api_key)
        async with aiohttp.ClientSession(
            timeout=timeout, connector=connector, headers=headers
        ) as session:
            if self.config.concurrency is None:
                await self._open_loop(session, specs)
            else:
                await self._closed_loop(session, specs)
            outcomes = await asyncio.gather(*self._tasks, return_exceptions=True)
        # Cancelled tasks are the interrupt at work; any other exception is a bug to show.
        for result in outcomes:
            if isinstance(result, Exception):
                raise result
        duration = time.perf_counter() - self._t0
        if self._interrupted:
            stopped_by = "interrupted"
        elif self._cut_by_duration:
            stopped_by = "duration"
        else:
            stopped_by = "completed"
        return RunOutcome(self.records, duration, stopped_by, self._abandoned, started_at)

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _issuing(self) -> bool:
        """Whether the next request may go; called only when one is waiting to."""
        if self._stop.is_set():
            return False
        deadline = self.config.duration_s
        if deadline is not None and self._now() >= deadline:
            self._cut_by_duration = True
            return False
        return True

    async def _wait_until(self, due_s: float) -> bool:
        """Sleep until ``due_s`` (run time); False if stopped or past the duration first."""
        deadline = self.config.duration_s
        until = due_s if deadline is None else min(due_s, deadline)
        delay = until - self._now()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
        return self._issuing() and self._now() >= due_s - 1e-3

    async def _open_loop(
        self, session: aiohttp.ClientSession, specs: Iterable[RequestSpec]
    ) -> None:
        rng = random.Random(self.config.seed)
        poisson_due = 0.0
        for index, spec in enumerate(specs):
            if self.config.rate is None:
                due = spec.arrival_s * self.config.time_scale
            else:
                due = poisson_due
                poisson_due += rng.expovariate(self.config.rate)
            if not await self._wait_until(due):
                return
            self._spawn(self._run_item(session, index, spec))

    async def _closed_loop(
        self, session: aiohttp.ClientSession, specs: Iterable[RequestSpec]
    ) -> None:
        items = enumerate(specs)  # shared by all users: each takes the next item

        async def user() -> None:
            for index, spec in items:
                if not self._issuing():
                    return
                await self._run_item(session, index, spec)

        for _ in range(self.config.concurrency or 1):
            self._spawn(user())

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_item(
        self, session: aiohttp.ClientSession, index: int, spec: RequestSpec
    ) -> None:
        base = api_base(self.config.endpoint)
        params = {"model": self.config.model, "max_tokens": spec.max_tokens, "temperature": 0}
        if self.config.ignore_eos:
            params["ignore_eos"] = True
        if not spec.is_chat:
            prompt = spec.prompt if isinstance(spec.prompt, str) else list(spec.prompt or ())
            await self._send(session, base + "/completions", {**params, "prompt": prompt}, index, 0)
        else:
            messages = [{"role": "system", "content": spec.system}] if spec.system else []
            for turn, user_text in enumerate(spec.user_turns):
                if turn and not self._issuing():
                    break
                messages.append({"role": "user", "content": user_text})
                body = {**params, "messages": list(messages)}
                record, answer = await self._send(
                    session, base + "/chat/completions", body, index, turn
                )
                if not record.ok:
                    break  # a failed turn has no answer for the next one to carry
                messages.append({"role": "assistant", "content": answer})
        if self.progress is not None:
            self.progress.item_done()

    async def _send(
        self, session: aiohttp.ClientSession, url: str, body: dict[str, Any], index: int, turn: int
    ) -> tuple[RequestRecord, str]:
        record = RequestRecord(item=index, turn=turn, start_s=self._now())
        try:
            answer = await stream_request(session, url, body, record)
        except asyncio.CancelledError:
            self._abandoned += 1
            raise
        self.records.append(record)
        if self.progress is not None:
            self.progress.record(record)
        return record, answer
