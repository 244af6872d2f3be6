"""The workers ordered by load, kept up to date as loads change, for kv_aware's candidates.

kv_aware predicts each worker's time to first token; a worker that holds none of the
prompt differs from another only by its load term::

    min(queued_s, guarded_s) + in_flight_requests × decode_request_s

(see :func:`kvserve.core.routing.kv_aware.predict`). Predicting every worker to find the
smallest term costs a prediction per worker per request: the decision then grows with
the fleet. This structure finds the worker with the smallest term without a scan. The
term is the smaller of ``guarded_s + r`` and ``queued_s + r`` (``r`` the requests term),
so its minimum is the smaller of the two minima:

- ``guarded_s + r`` changes only when the router's guards do: one sorted order.
- ``queued_s + r = max(r, done_at + r - now)`` moves with the clock; its minimum comes
  from two time-free orders, by ``r`` and by ``done_at + r``, walked together until no
  worker not yet seen can beat the best one seen (Fagin's threshold algorithm).

Entries equal in key are visited from an offset chosen by the request's tie key, so
that the misses of an idle fleet spread over all of it instead of the first workers by
name, and every replica holding the same loads picks the same.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Container, Iterator, KeysView
from dataclasses import dataclass

from kvserve.core.routing.types import WorkerLoad

GuardedSeconds = Callable[[int], float]  # prefill tokens held by guards -> seconds


Key = tuple[float, int, int]  # a load term, then the guards' sort key (ties as predicted)


class _Order:
    """(key, worker) pairs in ascending order; one entry per worker."""

    def __init__(self) -> None:
        self._entries: list[tuple[Key, str]] = []
        self._keys: dict[str, Key] = {}

    def set(self, worker_id: str, key: Key) -> None:
        old = self._keys.get(worker_id)
        if old == key:
            return
        if old is not None:
            del self._entries[bisect.bisect_left(self._entries, (old, worker_id))]
        self._keys[worker_id] = key
        bisect.insort(self._entries, (key, worker_id))

    def remove(self, worker_id: str) -> None:
        old = self._keys.pop(worker_id, None)
        if old is not None:
            del self._entries[bisect.bisect_left(self._entries, (old, worker_id))]

    def ascending(self, tie_key: int) -> Iterator[tuple[Key, str]]:
        """All entries by key; those equal to the smallest key start at an offset."""
        entries = self._entries
        if not entries:
            return
        tied = bisect.bisect_right(entries, (entries[0][0], "\U0010ffff"))  # same key
        start = tie_key % tied
        yield from entries[start:tied]
        yield from entries[:start]
        yield from entries[tied:]


@dataclass(slots=True)
class _Load:
    requests_s: float
    guarded_s: float
    done_at: float
    sort_key: tuple[int, int]


class LoadOrder:
    """Every worker's load terms, in the three orders the module docstring describes."""

    def __init__(self, guarded_seconds: GuardedSeconds, decode_request_s: float) -> None:
        self._guarded_seconds = guarded_seconds
        self._decode_request_s = decode_request_s
        self._loads: dict[str, _Load] = {}
        self._by_guarded = _Order()
        self._by_requests = _Order()
        self._by_done = _Order()

    @property
    def known(self) -> KeysView[str]:
        return self._loads.keys()

    def update(self, load: WorkerLoad) -> None:
        """The router's guards on one worker changed (or it was first seen)."""
        entry = self._loads.get(load.worker_id)
        requests_s = load.in_flight_requests * self._decode_request_s
        guarded_s = self._guarded_seconds(load.in_flight_prefill_tokens)
        if entry is None:
            entry = self._loads[load.worker_id] = _Load(requests_s, guarded_s, 0.0, load.sort_key)
        else:
            entry.requests_s, entry.guarded_s = requests_s, guarded_s
            entry.sort_key = load.sort_key
        self._reorder(load.worker_id, entry)

    def set_done(self, worker_id: str, done_at: float) -> None:
        """This policy's predicted end of the prefills it queued on ``worker_id``."""
        entry = self._loads.get(worker_id)
        if entry is not None:
            entry.done_at = done_at
            self._by_done.set(worker_id, (done_at + entry.requests_s, *entry.sort_key))

    def remove(self, worker_id: str) -> None:
        self._loads.pop(worker_id, None)
        for order in (self._by_guarded, self._by_requests, self._by_done):
            order.remove(worker_id)

    def lightest(
        self, eligible: Container[str], excluded: Container[str], now: float, tie_key: int
    ) -> set[str]:
        """Workers of ``eligible`` but not ``excluded`` among which is one whose load term
        is the smallest of all such known workers (two or three of them, usually)."""
        found: set[str] = set()
        first = _next_eligible(self._by_guarded.ascending(tie_key), eligible, excluded)
        if first is not None:
            found.add(first[1])
        best = float("inf")
        by_requests = self._by_requests.ascending(tie_key)
        by_done = self._by_done.ascending(tie_key)
        while True:
            step_requests = _next_eligible(by_requests, eligible, excluded)
            step_done = _next_eligible(by_done, eligible, excluded)
            if step_requests is None or step_done is None:
                return found  # both orders hold the same workers: all were seen
            for step in (step_requests, step_done):
                found.add(step[1])
                best = min(best, self._queued_term(step[1], now))
            floor_requests, floor_done = step_requests[0][0], step_done[0][0] - now
            # no unseen worker has a smaller requests term or an earlier end than the last
            # seen in each order, so none has a term below this floor
            if best <= max(floor_requests, floor_done):
                return found

    def _queued_term(self, worker_id: str, now: float) -> float:
        entry = self._loads[worker_id]
        return max(0.0, entry.done_at - now) + entry.requests_s

    def _reorder(self, worker_id: str, entry: _Load) -> None:
        self._by_guarded.set(worker_id, (entry.guarded_s + entry.requests_s, *entry.sort_key))
        self._by_requests.set(worker_id, (entry.requests_s, *entry.sort_key))
        self._by_done.set(worker_id, (entry.done_at + entry.requests_s, *entry.sort_key))


def _next_eligible(
    entries: Iterator[tuple[Key, str]], eligible: Container[str], excluded: Container[str]
) -> tuple[Key, str] | None:
    for entry in entries:
        if entry[1] in eligible and entry[1] not in excluded:
            return entry
    return None
