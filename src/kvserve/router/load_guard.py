"""Exact load accounting: what this router has in flight on each worker.

A guard is taken when a worker is selected for a request (one per attempt) and holds one
in-flight request plus the request's estimated prefill tokens (under kv_aware, only the
part the worker is predicted not to hold: see ``proxy.guarded_prefill_tokens``). The
prefill part is released when the first token arrives (prefill is over); the whole guard
is released exactly once, whatever ends the attempt: success, an upstream error, a client
disconnect, a timeout, a retry elsewhere, or the worker's removal. Releases are idempotent
so that every exit path can release without counting twice.

With router replicas (``--peers``), what the peers announced they hold is added to each
worker's load (``peer_load``): the policy then sees the fleet's in-flight requests as one
router would. The listener and :meth:`LoadTracker.total_held` see this router's own guards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvserve.core.routing.types import WorkerLoad

LoadListener = Callable[[WorkerLoad], None]
PeerLoad = Callable[[str], tuple[int, int]]  # worker -> the peers' (requests, prefill tokens)


class LoadTracker:
    """In-flight requests and prefill tokens per worker, held by live guards only.

    Each worker's load is kept as the :class:`WorkerLoad` a selection is given, built
    when its guards change rather than when it is read: every request reads the load
    of every accepting worker, and building a frozen dataclass per worker per request
    was most of the router's CPU per decision at 1,000 workers (benchmarks/
    router_select.py). Idle workers share a cached zero load per id.
    """

    _IDLE_CACHE = 65_536  # idle loads kept; past it the cache starts over (ids of removed
    # workers are never reused, so it must not grow with churn)

    def __init__(
        self, on_change: LoadListener | None = None, peer_load: PeerLoad | None = None
    ) -> None:
        self._held: dict[str, WorkerLoad] = {}
        self._idle: dict[str, WorkerLoad] = {}
        self._on_change = on_change
        self.peer_load = peer_load

    def acquire(self, worker_id: str, prefill_tokens: int) -> LoadGuard:
        self._adjust(worker_id, 1, prefill_tokens)
        return LoadGuard(self, worker_id, prefill_tokens)

    def load(self, worker_id: str) -> WorkerLoad:
        """This router's guards on ``worker_id``, plus what its peers announced."""
        own = self.own_load(worker_id)
        if self.peer_load is None:
            return own
        peer_requests, peer_tokens = self.peer_load(worker_id)
        if not peer_requests and not peer_tokens:
            return own
        return WorkerLoad(
            worker_id,
            own.in_flight_requests + peer_requests,
            own.in_flight_prefill_tokens + peer_tokens,
        )

    def own_load(self, worker_id: str) -> WorkerLoad:
        """This router's own guards on ``worker_id``."""
        load = self._held.get(worker_id) or self._idle.get(worker_id)
        if load is None:
            if len(self._idle) >= self._IDLE_CACHE:
                self._idle.clear()
            load = self._idle[worker_id] = WorkerLoad(worker_id)
        return load

    def held_worker_ids(self) -> list[str]:
        """The workers some live guard holds load on (removed workers included)."""
        return list(self._held)

    def total_held(self) -> WorkerLoad:
        """Everything held on all workers; zero whenever the router is idle."""
        held = self._held.values()
        return WorkerLoad(
            "*",
            sum(load.in_flight_requests for load in held),
            sum(load.in_flight_prefill_tokens for load in held),
        )

    def _adjust(self, worker_id: str, requests: int, prefill_tokens: int) -> None:
        current = self._held.get(worker_id)
        held_requests = requests + (current.in_flight_requests if current else 0)
        held_tokens = prefill_tokens + (current.in_flight_prefill_tokens if current else 0)
        if held_requests < 0 or held_tokens < 0:
            raise AssertionError(f"load on {worker_id} released more than acquired")
        load = WorkerLoad(worker_id, held_requests, held_tokens)
        if held_requests == 0 and held_tokens == 0:
            self._held.pop(worker_id, None)
        else:
            self._held[worker_id] = load
        if self._on_change is not None:
            self._on_change(load)


class Guard(Protocol):
    """What the proxy holds for one attempt: one worker's guard, or (PD) a pair's."""

    @property
    def prefill_released(self) -> bool: ...

    def release_prefill(self) -> None: ...

    def release(self) -> None: ...


class LoadGuard:
    """The load one attempt holds on one worker."""

    def __init__(self, tracker: LoadTracker, worker_id: str, prefill_tokens: int) -> None:
        self._tracker = tracker
        self.worker_id = worker_id
        self._prefill_tokens = prefill_tokens
        self.prefill_released = False
        self.released = False

    def release_prefill(self) -> None:
        """The first token arrived: this request no longer queues prefill work."""
        if not self.prefill_released:
            self.prefill_released = True
            self._tracker._adjust(self.worker_id, 0, -self._prefill_tokens)

    def release(self) -> None:
        """Release everything still held; later calls do nothing."""
        if not self.released:
            tokens = 0 if self.prefill_released else self._prefill_tokens
            self.prefill_released = self.released = True
            self._tracker._adjust(self.worker_id, -1, -tokens)
