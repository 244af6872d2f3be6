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

Each worker's entry (:class:`LoadEntry`) is the one place its load terms are kept: the
orders, the heap and the arrays are drawn from it, and kv_aware's predictions read it.

A change of load is written to the worker's entry at once, and to the orders, the heap
and the arrays only when a search next reads them: a fleet small enough to be predicted
whole never searches, and paid ~3 µs a decision keeping them (a queue end pushed, two
orders and six array cells rewritten) for nothing. Once searches come (a larger fleet),
the router's guard changes are written as they come again, between decisions rather than
inside the next one; a decision's own queue end still waits for the next search.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Container, Iterable, Iterator, KeysView, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvserve.core.routing.types import WorkerLoad

GuardedSeconds = Callable[[int], float]  # prefill tokens held by guards -> seconds
SlotOf = Callable[[str], int]  # worker -> its slot in the KV index's masks


Key = tuple[float, int, int]  # a load term, then the guards' sort key (ties as predicted)
_GUARDS, _DONE = 1, 2  # what changed on a worker since the orders were brought up to date
_NEVER = float("-inf")  # the queue end of a worker this policy queued nothing on


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
        # by position, not slices: a slice would copy the order for one or two steps
        for i in range(start, tied):
            yield entries[i]
        for i in range(start):
            yield entries[i]
        for i in range(tied, len(entries)):
            yield entries[i]


@dataclass(slots=True)
class LoadEntry:
    """One worker's load terms, the only place they are kept: the orders, the heap and
    the arrays are drawn from these, and kv_aware's predictions read them
    (``KvAwareRouting._score``). ``load`` is the :class:`WorkerLoad` they were computed
    from: the router's tracker keeps one object per worker until its guards change, so
    the object is their version."""

    load: WorkerLoad
    fixed_s: float  # in-flight requests x decode_request_s + others' prefill seconds
    guarded_s: float  # prefill seconds the guards hold
    done_at: float  # this policy's predicted end of the prefill it queued there
    sort_key: tuple[int, int]
    slot: int
    # where the slot's first bit lies in a mask's little-endian bytes: a whole fleet's
    # scoring finds each worker in a prompt's layers of holders by one byte lookup
    mask_byte: int
    mask_bit: int


def load_term(entry: LoadEntry, queued_s: float) -> float:
    """A worker's load term: ``min(queued_s, guarded_s) + fixed_s``, a queue already
    drained (``queued_s <= 0``) counting 0: the floats kv_aware's ``_load_term`` gives."""
    if queued_s <= 0.0:
        return entry.fixed_s
    guarded_s = entry.guarded_s
    return (queued_s if queued_s < guarded_s else guarded_s) + entry.fixed_s


class _SlotTerms:
    """The load terms again, as arrays indexed by the index's worker slots: the lightest
    of a group given as a mask is found in a few array operations, however large."""

    def __init__(self) -> None:
        self.fixed_s = np.full(_FIRST_SLOTS, np.inf)  # inf: no worker in the slot
        self.guarded_s = np.zeros(_FIRST_SLOTS)
        self.done_at = np.full(_FIRST_SLOTS, -np.inf)
        self.requests = np.zeros(_FIRST_SLOTS)  # the sort key, as floats
        self.tokens = np.zeros(_FIRST_SLOTS)
        self.name_rank = np.zeros(_FIRST_SLOTS)  # the worker's place among all by name

    def set(self, entry: LoadEntry) -> None:
        slot = entry.slot
        if slot >= len(self.fixed_s):
            size = max(slot + 1, 2 * len(self.fixed_s))
            self.fixed_s = _grown(self.fixed_s, size, np.inf)
            self.guarded_s = _grown(self.guarded_s, size, 0.0)
            self.done_at = _grown(self.done_at, size, -np.inf)
            self.requests = _grown(self.requests, size, 0.0)
            self.tokens = _grown(self.tokens, size, 0.0)
            self.name_rank = _grown(self.name_rank, size, 0.0)
        self.fixed_s[slot] = entry.fixed_s
        self.guarded_s[slot] = entry.guarded_s
        self.done_at[slot] = entry.done_at
        self.requests[slot], self.tokens[slot] = entry.sort_key

    def clear(self, slot: int) -> None:
        if slot < len(self.fixed_s):
            self.fixed_s[slot] = np.inf

    def lightest(self, first_bits: int, bits_per_slot: int, now: float) -> npt.NDArray[np.intp]:
        """The slots of ``first_bits`` (one bit per slot, every ``bits_per_slot``-th)
        whose (load term rounded to the nanosecond, sort key) is the smallest, as
        :meth:`LoadOrder.lightest_among` ranks them: the slots equal to the first such
        in (term, sort key) exactly, not those equal only once rounded (a tie left to
        chance either way)."""
        size = (first_bits.bit_length() + 7) // 8
        raw = np.frombuffer(first_bits.to_bytes(size, "little"), np.uint8)
        kept = len(self.fixed_s) * bits_per_slot  # slots past the arrays hold no worker
        slots = np.flatnonzero(np.unpackbits(raw, bitorder="little")[:kept:bits_per_slot])
        fixed = self.fixed_s[slots]
        # min(queued, guarded) where a queue is left (else 0) + fixed: a drained queue's
        # negative remainder clipped to 0 leaves the fixed part alone
        queued = np.maximum(self.done_at[slots] - now, 0.0)
        term = np.minimum(queued, self.guarded_s[slots]) + fixed
        lightest = term.min() if len(term) else np.inf
        if lightest == np.inf:
            return slots[:0]
        # whatever rounds to the smallest term is within 1 ns of it
        near = term <= lightest + 2e-9
        slots, term = slots[near], term[near]
        if len(slots) <= _RANK_IN_PYTHON:
            return self._lightest_few(slots, term)
        requests, tokens = self.requests[slots], self.tokens[slots]
        if term.max() == lightest:  # one term (an idle group, say): rank by sort key alone
            fewest = requests == requests.min()
            return slots[fewest & (tokens == tokens[fewest].min())]  # type: ignore[no-any-return]
        # rounded as Python rounds, once per distinct term (equal loads share one)
        values, inverse = np.unique(term, return_inverse=True)
        rounded = np.array([round(float(v), 9) for v in values])[inverse]
        best = np.lexsort((tokens, requests, rounded))[0]
        equal = (term == term[best]) & (requests == requests[best]) & (tokens == tokens[best])
        return slots[equal]  # type: ignore[no-any-return]

    def _lightest_few(
        self, slots: npt.NDArray[np.intp], term: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.intp]:
        """:meth:`lightest`'s ranking of a few near-lightest slots, one by one: cheaper
        than the sorts that rank many (a call each, whatever the size)."""
        requests, tokens = self.requests[slots].tolist(), self.tokens[slots].tolist()
        exact = list(zip(term.tolist(), requests, tokens, strict=True))
        keys = [(round(t, 9), r, k) for t, r, k in exact]
        best = exact[min(range(len(keys)), key=keys.__getitem__)]
        return slots[[i for i, key in enumerate(exact) if key == best]]


_FIRST_SLOTS = 64
_RANK_IN_PYTHON = 8  # near-lightest slots ranked in Python up to this many, else sorted


def _grown(values: npt.NDArray[np.float64], size: int, fill: float) -> npt.NDArray[np.float64]:
    grown = np.full(size, fill)
    grown[: len(values)] = values
    return grown


class LoadOrder:
    """Every worker's load terms, in the three orders the module docstring describes."""

    def __init__(
        self,
        guarded_seconds: GuardedSeconds,
        decode_request_s: float,
        slot_of: SlotOf,
        bits_per_slot: int,
    ) -> None:
        self._guarded_seconds = guarded_seconds
        self._decode_request_s = decode_request_s
        self._slot_of = slot_of
        self._bits_per_slot = bits_per_slot
        self._loads: dict[str, LoadEntry] = {}
        # queue ends set before the worker's first load (a peer replica's choice, say):
        # its entry starts from it, so that the entry is the one place a queue end is read
        self._unseen_done: dict[str, float] = {}
        self._terms = _SlotTerms()
        self._slot_workers: dict[int, str] = {}
        self._name_ranks_stale = False  # a worker came or went since they were drawn
        self._by_guarded = _Order()
        self._drained = _Order()  # by requests term
        self._queued = _Order()  # by queue end + requests term
        self._ends: list[tuple[float, str]] = []  # queue ends, soonest first
        self._now = float("-inf")  # the time the two classes are drawn at
        # workers whose entry changed since the orders were last brought up to date:
        # worker -> _GUARDS | _DONE (what changed)
        self._stale: dict[str, int] = {}
        self._searched = False  # a search read the orders: guard changes written at once

    @property
    def known(self) -> KeysView[str]:
        return self._loads.keys()

    @property
    def entries(self) -> Mapping[str, LoadEntry]:
        """Each known worker's load terms (read only: :meth:`update` writes them)."""
        return self._loads

    def update(self, load: WorkerLoad) -> LoadEntry:
        """The router's guards on one worker changed (or it was first seen); returns its
        entry. A new object with the same loads only replaces the entry's ``load``."""
        worker_id = load.worker_id
        entry = self._loads.get(worker_id)
        fixed_s = load.in_flight_requests * self._decode_request_s + self._guarded_seconds(
            load.others_prefill_tokens
        )
        guarded_s = self._guarded_seconds(load.in_flight_prefill_tokens)
        sort_key = load.sort_key
        if entry is None:
            slot = self._slot_of(worker_id)
            position = slot * self._bits_per_slot
            byte, bit = position >> 3, 1 << (position & 7)
            entry = self._loads[worker_id] = LoadEntry(
                load, fixed_s, guarded_s, _NEVER, sort_key, slot, byte, bit
            )
            self._slot_workers[slot] = worker_id
            self._name_ranks_stale = True
            done_at = self._unseen_done.pop(worker_id, None)
            if done_at is not None:
                self.set_done(worker_id, done_at)
        else:
            entry.load = load
            if (
                entry.fixed_s == fixed_s
                and entry.guarded_s == guarded_s
                and entry.sort_key == sort_key
            ):
                return entry
            entry.fixed_s, entry.guarded_s, entry.sort_key = fixed_s, guarded_s, sort_key
        if self._searched:
            self._by_guarded.set(worker_id, (guarded_s + fixed_s, *sort_key))
            self._classify(worker_id, entry)
        else:
            stale = self._stale
            stale[worker_id] = stale.get(worker_id, 0) | _GUARDS
        return entry

    def done_at(self, worker_id: str) -> float | None:
        """This policy's predicted end of the prefills it queued on ``worker_id`` (None:
        it queued none there)."""
        entry = self._loads.get(worker_id)
        if entry is None:
            return self._unseen_done.get(worker_id)
        return None if entry.done_at == _NEVER else entry.done_at

    def set_done(self, worker_id: str, done_at: float) -> None:
        """This policy's predicted end of the prefills it queued on ``worker_id``."""
        entry = self._loads.get(worker_id)
        if entry is None:
            self._unseen_done[worker_id] = done_at
            return
        entry.done_at = done_at
        stale = self._stale
        stale[worker_id] = stale.get(worker_id, 0) | _DONE

    def remove(self, worker_id: str) -> None:
        entry = self._loads.pop(worker_id, None)
        self._stale.pop(worker_id, None)
        self._unseen_done.pop(worker_id, None)
        if entry is not None:
            self._terms.clear(entry.slot)
            self._slot_workers.pop(entry.slot, None)
            self._name_ranks_stale = True
        for order in (self._by_guarded, self._drained, self._queued):
            order.remove(worker_id)

    def _refresh(self) -> None:
        """Bring the orders, the heap of queue ends and the arrays up to date with the
        entries changed since: as if each change had been written when it was made
        (a queue end superseded before then would have been skipped by ``_advance``)."""
        self._searched = True
        for worker_id, changed in self._stale.items():
            entry = self._loads[worker_id]
            if changed & _GUARDS:
                key = (entry.guarded_s + entry.fixed_s, *entry.sort_key)
                self._by_guarded.set(worker_id, key)
            if changed & _DONE:
                heapq.heappush(self._ends, (entry.done_at, worker_id))
            self._classify(worker_id, entry)
        self._stale.clear()

    def lightest(
        self, eligible: Container[str], excluded: Container[str], now: float, tie_key: int
    ) -> set[str]:
        """Workers of ``eligible`` but not ``excluded`` among which is one whose load term
        is the smallest of all such known workers (the first taken in each order)."""
        self._refresh()
        self._advance(now)
        found: set[str] = set()
        for order in (self._by_guarded, self._drained, self._queued):
            for _, worker_id in order.ascending(tie_key):
                if worker_id in eligible and worker_id not in excluded:
                    found.add(worker_id)
                    break
        return found

    def lightest_of_slots(
        self,
        first_bits: int,
        eligible: Container[str],
        now: float,
        tie_key: int,
    ) -> list[str]:
        """A worker of ``eligible`` whose slot's first bit is set in ``first_bits`` (a
        group from the KV index) and whose (load term, sort key) is the smallest of
        them, as :meth:`lightest_among` ranks them, found in the arrays without listing
        the group. Of several tied, the first eligible from ``tie_key``'s offset among
        their names, in name order from the ranks kept per slot (every replica holding
        the same loads picks the same; no sort of the tied per decision). Where none of
        the tied is eligible (workers taken out, or tried) they are dropped from the
        group and the search repeated."""
        self._refresh()  # first: the arrays grow to every known slot
        if self._name_ranks_stale:  # once after workers come or go, not per decision
            for rank, worker_id in enumerate(sorted(self._loads)):
                self._terms.name_rank[self._loads[worker_id].slot] = rank
            self._name_ranks_stale = False
        workers, bits_per_slot = self._slot_workers, self._bits_per_slot
        while True:
            tied = self._terms.lightest(first_bits, bits_per_slot, now)
            if len(tied) == 1:  # most decisions: no tie to break by name
                worker_id = workers[int(tied[0])]
                if worker_id in eligible:
                    return [worker_id]
                first_bits &= ~(1 << int(tied[0]) * bits_per_slot)
                continue
            if not len(tied):
                return []
            by_name = np.argsort(self._terms.name_rank[tied])
            start = tie_key % len(tied)
            for i in range(len(tied)):  # the first, unless taken out or tried
                worker_id = workers[int(tied[by_name[(start + i) % len(tied)]])]
                if worker_id in eligible:
                    return [worker_id]
            for slot in tied.tolist():
                first_bits &= ~(1 << slot * bits_per_slot)

    def lightest_among(self, members: Iterable[str], now: float) -> list[str]:
        """The workers of ``members`` (all known) whose (load term rounded to the
        nanosecond, sort key) is the smallest, every tied one: a scan, but of the terms
        kept here, a few float operations per member instead of a prediction. Only the
        members within 2 ns of the smallest term (all that can round to it) are ranked:
        a tuple and a rounding per member made the scan twice as slow."""
        loads = self._loads
        terms: list[tuple[float, str]] = []
        lightest = float("inf")
        for worker_id in members:
            entry = loads[worker_id]
            term = load_term(entry, entry.done_at - now)
            if term < lightest:
                lightest = term
            terms.append((term, worker_id))
        near_s = lightest + 2e-9
        ranked = [
            ((round(term, 9), *loads[worker_id].sort_key), worker_id)
            for term, worker_id in terms
            if term <= near_s
        ]
        best = min(ranked)[0] if ranked else None
        return [worker_id for key, worker_id in ranked if key == best]

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

    def _classify(self, worker_id: str, entry: LoadEntry) -> None:
        self._terms.set(entry)
        if entry.done_at > self._now:
            self._drained.remove(worker_id)
            self._queued.set(worker_id, (entry.done_at + entry.fixed_s, *entry.sort_key))
        else:
            self._queued.remove(worker_id)
            self._drained.set(worker_id, (entry.fixed_s, *entry.sort_key))
