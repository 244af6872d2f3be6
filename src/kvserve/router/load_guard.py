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
    """In-flight requests and prefill tokens per worker, held by live guards only."""

    def __init__(
        self, on_change: LoadListener | None = None, peer_load: PeerLoad | None = None
    ) -> None:
        self._requests: dict[str, int] = {}
        self._prefill_tokens: dict[str, int] = {}
        self._on_change = on_change
        self.peer_load = peer_load

    def acquire(self, worker_id: str, prefill_tokens: int) -> LoadGuard:
        self._adjust(worker_id, 1, prefill_tokens)
        return LoadGuard(self, worker_id, prefill_tokens)

    def load(self, worker_id: str) -> WorkerLoad:
        """This router's guards on ``worker_id``, plus what its peers announced."""
        if self.peer_load is None:
            return self.own_load(worker_id)
        peer_requests, peer_tokens = self.peer_load(worker_id)
        return WorkerLoad(
            worker_id,
            self._requests.get(worker_id, 0) + peer_requests,
            self._prefill_tokens.get(worker_id, 0) + peer_tokens,
        )

    def own_load(self, worker_id: str) -> WorkerLoad:
        """This router's own guards on ``worker_id``."""
        return WorkerLoad(
            worker_id,
            self._requests.get(worker_id, 0),
            self._prefill_tokens.get(worker_id, 0),
        )

    def held_worker_ids(self) -> list[str]:
        """The workers some live guard holds load on (removed workers included)."""
        return list(self._requests)

    def total_held(self) -> WorkerLoad:
        """Everything held on all workers; zero whenever the router is idle."""
        return WorkerLoad("*", sum(self._requests.values()), sum(self._prefill_tokens.values()))

    def _adjust(self, worker_id: str, requests: int, prefill_tokens: int) -> None:
        held_requests = self._requests.get(worker_id, 0) + requests
        held_tokens = self._prefill_tokens.get(worker_id, 0) + prefill_tokens
        if held_requests < 0 or held_tokens < 0:
            raise AssertionError(f"load on {worker_id} released more than acquired")
        if held_requests == 0 and held_tokens == 0:
            self._requests.pop(worker_id, None)
            self._prefill_tokens.pop(worker_id, None)
        else:
            self._requests[worker_id] = held_requests
            self._prefill_tokens[worker_id] = held_tokens
        if self._on_change is not None:
            self._on_change(WorkerLoad(worker_id, held_requests, held_tokens))


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
