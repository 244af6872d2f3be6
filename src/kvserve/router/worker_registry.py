"""The fleet as the router knows it: ids, URLs, health and breakers, changed at run time."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.router.circuit_breaker import BreakerState, CircuitBreaker
from kvserve.router.config import CircuitBreakerConfig, HealthCheckConfig
from kvserve.router.kv_event_source import KVEventSource, describe

if TYPE_CHECKING:
    from kvserve.router.taken_out import AnswerWatch


@dataclass
class Worker:
    """One upstream server. ``healthy`` is None until its first health check answers."""

    worker_id: str
    url: str
    breaker: CircuitBreaker
    pool: str = "regular"
    kv_events: KVEventSource = None  # None: the worker's HTTP stream
    healthy: bool | None = None
    ever_healthy: bool = False  # False while it may still be starting up
    instance: str | None = None  # the process its /health last named, if it names one
    # Attempts waiting for its answer's headers (see router/taken_out.py).
    waiting_for_answer: set[AnswerWatch] = field(default_factory=set, repr=False)
    _streak_ok: int = field(default=0, repr=False)
    _streak_failed: int = field(default=0, repr=False)
    # Called when ``healthy`` is set (the registry's accepting lists may change).
    on_health_change: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name == "healthy":
            notify = getattr(self, "on_health_change", None)
            if notify is not None:
                notify()

    def accepts_traffic(self, now: float) -> bool:
        return bool(self.healthy) and self.breaker.allows(now)

    @property
    def suspect(self) -> bool:
        """Whether its state may be about to change: never healthy yet, unhealthy, its
        last check failed, or its breaker is not closed. The health checker checks such a
        worker every second, not every interval, to notice a death or a return quickly."""
        return (
            not self.healthy
            or self._streak_failed > 0
            or self.breaker.state is not BreakerState.CLOSED
        )

    def record_health(self, ok: bool, config: HealthCheckConfig) -> bool:
        """Count a health check; returns whether the worker's health changed.

        The first answer decides at once, and so does the first OK of a worker that was
        never healthy (a new or still-starting worker takes traffic as soon as it is up);
        afterwards it takes ``failure_threshold`` / ``success_threshold`` in a row. A
        worker healthy again has its breaker readmit it.
        """
        before = self.healthy
        if ok:
            self._streak_ok, self._streak_failed = self._streak_ok + 1, 0
            if not self.ever_healthy or self._streak_ok >= config.success_threshold:
                self.healthy = self.ever_healthy = True
            if before is False and self.healthy:
                self.breaker.readmit()
        else:
            self._streak_ok, self._streak_failed = 0, self._streak_failed + 1
            if self.healthy is None or self._streak_failed >= config.failure_threshold:
                self.healthy = False
        return before != self.healthy

    def record_instance(self, instance: str) -> bool:
        """The instance its ``/health`` named; returns whether it restarted since the last
        one (its breaker then readmits it: the failures were the old process's)."""
        restarted = self.instance is not None and instance != self.instance
        self.instance = instance
        if restarted:
            self.breaker.readmit()
        return restarted

    def describe(self) -> dict[str, object]:
        return {
            "id": self.worker_id,
            "url": self.url,
            "pool": self.pool,
            "kv_events": describe(self.kv_events),
            "healthy": self.healthy,
            "circuit": self.breaker.state.value,
        }


class WorkerRegistry:
    """Workers by stable id (``w0``, ``w1``, ... in order of arrival; never reused).

    Each pool's accepting workers are kept between requests rather than rebuilt from the
    whole fleet each time: the list is dropped when a worker joins or leaves, its health
    is set, or its breaker opens or stops being open. The one change no call announces,
    an open breaker's time running out, is found from a heap of reopening times looked
    at per request (nothing to do unless one is due).
    """

    def __init__(self, breaker_config: CircuitBreakerConfig) -> None:
        self._breaker_config = breaker_config
        self._workers: dict[str, Worker] = {}
        self._ids_by_url: dict[str, str] = {}
        self._next_index = 0
        # by pool; empty: all to rebuild. A tuple, handed out as it is: a new object
        # whenever the pool's accepting workers change, which is what views of it key on
        self._accepting: dict[str, tuple[Worker, ...]] = {}
        self._reopenings: list[tuple[float, str]] = []  # (open breaker's end, worker id)

    def add(self, url: str, pool: str = "regular", kv_events: KVEventSource = None) -> Worker:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL must start with http:// or https://: {url!r}")
        if url in self._ids_by_url:
            raise ValueError(f"worker {url} is already registered")
        breaker = CircuitBreaker(self._breaker_config)
        worker = Worker(f"w{self._next_index}", url, breaker, pool, kv_events)
        self._next_index += 1
        self._workers[worker.worker_id] = worker
        self._ids_by_url[url] = worker.worker_id
        worker.on_health_change = self._accepting.clear
        breaker.on_open_change = lambda: self._breaker_changed(worker)
        self._accepting.clear()
        return worker

    def remove(self, worker_id: str) -> Worker:
        worker = self._workers.pop(worker_id)
        del self._ids_by_url[worker.url]
        worker.on_health_change = worker.breaker.on_open_change = None
        self._accepting.clear()
        return worker

    def _breaker_changed(self, worker: Worker) -> None:
        self._accepting.clear()
        if worker.breaker.state is BreakerState.OPEN:
            heapq.heappush(self._reopenings, (worker.breaker.reopens_at, worker.worker_id))

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def id_of(self, url: str) -> str | None:
        """The id of the worker registered at ``url``, if any."""
        return self._ids_by_url.get(url.rstrip("/"))

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def accepting(self, now: float, pool: str, exclude: Iterable[str] = ()) -> Sequence[Worker]:
        """The pool's workers that take traffic at ``now``, in order of arrival: without
        ``exclude``, the kept tuple itself (the same object until the set changes)."""
        reopenings = self._reopenings
        while reopenings and reopenings[0][0] <= now:
            _, worker_id = heapq.heappop(reopenings)
            worker = self._workers.get(worker_id)
            if worker is not None:
                worker.breaker.allows(now)  # turns half-open if its time is up
        accepting = self._accepting.get(pool)
        if accepting is None:
            accepting = self._accepting[pool] = tuple(
                w for w in self._workers.values() if w.pool == pool and w.accepts_traffic(now)
            )
        skipped = set(exclude)
        if not skipped:
            return accepting
        return [w for w in accepting if w.worker_id not in skipped]
