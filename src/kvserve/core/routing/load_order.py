"""The workers ordered by load, kept up to date as loads change, for kv_aware's candidates.

kv_aware predicts each worker's time to first token; a worker that holds none of the
prompt differs from another only by its load term::

    min(queued_s, guarded_s) + in_flight_requests × decode_request_s + others_s

(see :func:`kvserve.core.routing.kv_aware.predict`). Predicting every worker to find the
smallest term costs a prediction per worker per request: the decision then grows with
the fleet. This structure finds the worker with the smallest term without a scan. The
term is the smaller of ``guarded_s + r`` and ``queued_s + r`` (``r`` the terms that
change only with the guards: requests, and the prefill other replicas reported), so its
minimum is the smaller of the two minima:

- ``guarded_s + r`` changes only when the router's guards do: one sorted order.
- ``queued_s + r`` moves with the clock, but not its order within two classes: a worker
  whose queue has drained (``done_at <= now``) has the term ``r``; one whose queue has
  not, ``done_at + r - now``. One order per class, by ``r`` and by ``done_at + r``; a
  heap of queue ends moves a worker from the second to the first when its end passes.

The smallest term is then the first eligible worker in one of the three orders: a
search walks each from the lightest until one is eligible (of the pool, not a holder).

Entries equal in key are visited from an offset chosen by the request's tie key, so
that the misses of an idle fleet spread over all of it instead of the first workers by
name, and every replica holding the same loads picks the same.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Container, Iterable, Iterator, KeysView
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
    fixed_s: float
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
        self._drained = _Order()  # by requests term
        self._queued = _Order()  # by queue end + requests term
        self._ends: list[tuple[float, str]] = []  # queue ends, soonest first
        self._now = float("-inf")  # the time the two classes are drawn at

    @property
    def known(self) -> KeysView[str]:
        return self._loads.keys()

    def update(self, load: WorkerLoad) -> None:
        """The router's guards on one worker changed (or it was first seen)."""
        entry = self._loads.get(load.worker_id)
        fixed_s = load.in_flight_requests * self._decode_request_s + self._guarded_seconds(
            load.others_prefill_tokens
        )
        guarded_s = self._guarded_seconds(load.in_flight_prefill_tokens)
        if entry is None:
            entry = self._loads[load.worker_id] = _Load(fixed_s, guarded_s, 0.0, load.sort_key)
        else:
            entry.fixed_s, entry.guarded_s = fixed_s, guarded_s
            entry.sort_key = load.sort_key
        self._reorder(load.worker_id, entry)

    def set_done(self, worker_id: str, done_at: float) -> None:
        """This policy's predicted end of the prefills it queued on ``worker_id``."""
        entry = self._loads.get(worker_id)
        if entry is not None:
            entry.done_at = done_at
            heapq.heappush(self._ends, (done_at, worker_id))
            self._classify(worker_id, entry)

    def remove(self, worker_id: str) -> None:
        self._loads.pop(worker_id, None)
        for order in (self._by_guarded, self._drained, self._queued):
            order.remove(worker_id)

    def lightest(
        self, eligible: Container[str], excluded: Container[str], now: float, tie_key: int
    ) -> set[str]:
        """Workers of ``eligible`` but not ``excluded`` among which is one whose load term
        is the smallest of all such known workers (the first taken in each order)."""
        self._advance(now)
        found: set[str] = set()
        for order in (self._by_guarded, self._drained, self._queued):
            for _, worker_id in order.ascending(tie_key):
                if worker_id in eligible and worker_id not in excluded:
                    found.add(worker_id)
                    break
        return found

    def lightest_among(self, members: Iterable[str], now: float) -> list[str]:
        """The workers of ``members`` (all known) whose (load term rounded to the
        nanosecond, sort key) is the smallest, every tied one: a scan, but of the terms
        kept here, a few float operations per member instead of a prediction."""
        best: Key | None = None
        lightest: list[str] = []
        loads = self._loads
        for worker_id in members:
            entry = loads[worker_id]
            queued_s = entry.done_at - now
            if queued_s <= 0.0:
                term = entry.fixed_s
            else:
                term = min(queued_s, entry.guarded_s) + entry.fixed_s
            key = (round(term, 9), *entry.sort_key)
            if best is None or key < best:
                best, lightest = key, [worker_id]
            elif key == best:
                lightest.append(worker_id)
        return lightest

    def _advance(self, now: float) -> None:
        """Move the workers whose queue ended by ``now`` to the drained class."""
        if now < self._now:  # the clock went back (a caller's own clock): redraw all
            self._now = now
            for worker_id, entry in self._loads.items():
                self._classify(worker_id, entry)
            return
        self._now = now
        ends = self._ends
        while ends and ends[0][0] <= now:
            done_at, worker_id = heapq.heappop(ends)
            current = self._loads.get(worker_id)
            if current is not None and current.done_at == done_at:
                self._classify(worker_id, current)

    def _classify(self, worker_id: str, entry: _Load) -> None:
        if entry.done_at > self._now:
            self._drained.remove(worker_id)
            self._queued.set(worker_id, (entry.done_at + entry.fixed_s, *entry.sort_key))
        else:
            self._queued.remove(worker_id)
            self._drained.set(worker_id, (entry.fixed_s, *entry.sort_key))

    def _reorder(self, worker_id: str, entry: _Load) -> None:
        self._by_guarded.set(worker_id, (entry.guarded_s + entry.fixed_s, *entry.sort_key))
        self._classify(worker_id, entry)
