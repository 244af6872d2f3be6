"""The fleet's KV blocks as the workers report them: which worker holds which block, per tier.

Built from KV events alone (stored / removed / cleared, :mod:`kvserve.core.kv_events`), so
every router replica fed by the same events holds the same index: no replica learns a
private view from its own routing history. Hashes carry the model's namespace, so one
index serves every model and pool without mixing them; a worker belongs to one pool, and
only that pool's workers are ever scored.

Speculative entries cover the gap between routing a request and the worker's first
``stored`` event: a burst of requests sharing a new prefix follows the first one instead
of scattering. They expire at a deadline (the clock is passed in) unless an event
confirms them, so a request that failed or went elsewhere leaves nothing behind.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvserve.core.kv_events import KVEvent

TIERS: tuple[str, ...] = ("device", "host", "storage")  # fastest first
SPECULATIVE_TIER = "device"  # where a routed request's blocks will be computed


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    """A worker's longest held prefix of a request's blocks, split by the tier it is in.

    Each block counts in its fastest tier; ``speculative`` blocks are predicted from
    recent routing (device tier once computed), not reported yet.
    """

    blocks_by_tier: dict[str, int]
    speculative: int = 0

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks_by_tier.values()) + self.speculative


class KVBlockIndex:
    """Block hash → workers holding it (and in which tiers), plus speculative entries.

    Who holds a block is one int per hash: bit ``slot × len(TIERS) + tier`` for each
    worker slot and tier. A dict and a set per hash made a fleet's index hundreds of
    thousands of objects for CPython's cyclic collector to walk, each full collection a
    pause of the router's event loop; a dict of ints to ints is never tracked by the
    collector. Measured on 8 workers × 32,768 blocks: 534k tracked objects → 10k, a full
    collection 89 ms → 11 ms, a match of 375 blocks on 8 workers 0.19 ms → 0.05 ms.
    """

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}  # worker -> its bit group in the masks
        self._free_slots: list[int] = []  # of removed workers, all their bits cleared
        self._holders: dict[int, int] = {}  # hash -> mask of (worker slot, tier) bits
        # (worker, tier) -> hashes, so that ``cleared`` and worker removal are O(held)
        self._held: dict[tuple[str, str], set[int]] = {}
        # worker -> hash -> deadline; the heap orders deadlines for cleanup
        self._speculative: dict[str, dict[int, float]] = {}
        self._deadlines: list[tuple[float, str, int]] = []

    # ---------------------------------------------------------------- what workers report

    def apply(self, worker_id: str, event: KVEvent) -> None:
        """Apply one event of ``worker_id``'s stream (the caller checks sequence numbers)."""
        if event.kind == "stored":
            self._store(worker_id, event.tier, event.block_hashes)
        elif event.kind == "removed":
            self._remove(worker_id, event.tier, event.block_hashes)
        else:
            self._clear(worker_id, event.tier)

    def replace(self, worker_id: str, tier: str, block_hashes: Iterable[int]) -> None:
        """Replace what ``worker_id`` holds in ``tier`` by a snapshot's blocks."""
        self._clear(worker_id, tier)
        self._store(worker_id, tier, block_hashes)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker that left the fleet, speculation included."""
        for tier in [t for w, t in self._held if w == worker_id]:
            self._clear(worker_id, tier)
        self._speculative.pop(worker_id, None)
        slot = self._slots.pop(worker_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def num_blocks(self, worker_id: str, tier: str = "device") -> int:
        return len(self._held.get((worker_id, tier), ()))

    def holds(self, worker_id: str, block_hash: int, tier: str = "device") -> bool:
        slot = self._slots.get(worker_id)
        if slot is None:
            return False
        return bool(self._holders.get(block_hash, 0) & _bit(slot, tier))

    def _slot(self, worker_id: str) -> int:
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[worker_id] = slot
        return slot

    def _store(self, worker_id: str, tier: str, block_hashes: Iterable[int]) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown KV tier {tier!r}; expected one of {TIERS}")
        bit = _bit(self._slot(worker_id), tier)
        holders = self._holders
        held = self._held.setdefault((worker_id, tier), set())
        pending = self._speculative.get(worker_id)
        for block_hash in block_hashes:
            holders[block_hash] = holders.get(block_hash, 0) | bit
            held.add(block_hash)
            if pending:
                pending.pop(block_hash, None)  # confirmed: the event replaces the guess

    def _remove(self, worker_id: str, tier: str, block_hashes: Iterable[int]) -> None:
        held = self._held.get((worker_id, tier))
        if held is None:
            return
        bit = _bit(self._slots[worker_id], tier)
        for block_hash in block_hashes:
            if block_hash in held:
                held.discard(block_hash)
                self._drop_bit(block_hash, bit)

    def _clear(self, worker_id: str, tier: str) -> None:
        held = self._held.pop((worker_id, tier), ())
        if held:
            bit = _bit(self._slots[worker_id], tier)
            for block_hash in held:
                self._drop_bit(block_hash, bit)

    def _drop_bit(self, block_hash: int, bit: int) -> None:
        mask = self._holders[block_hash] & ~bit
        if mask:
            self._holders[block_hash] = mask
        else:
            del self._holders[block_hash]

    # ---------------------------------------------------------------- speculation

    def speculate(self, worker_id: str, block_hashes: Sequence[int], deadline: float) -> None:
        """Predict that ``worker_id`` will hold these blocks; forgotten after ``deadline``
        unless a ``stored`` event confirms them first."""
        pending = self._speculative.setdefault(worker_id, {})
        for block_hash in block_hashes:
            if not self.holds(worker_id, block_hash):
                pending[block_hash] = deadline
                heapq.heappush(self._deadlines, (deadline, worker_id, block_hash))

    def expire(self, now: float) -> int:
        """Drop speculative entries whose deadline passed; returns how many."""
        dropped = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, worker_id, block_hash = heapq.heappop(self._deadlines)
            pending = self._speculative.get(worker_id)
            if pending is not None and pending.get(block_hash) == deadline:
                del pending[block_hash]
                dropped += 1
        return dropped

    def num_speculative(self, worker_id: str) -> int:
        return len(self._speculative.get(worker_id, ()))

    # ---------------------------------------------------------------- queries

    def match(
        self, block_hashes: Sequence[int], worker_ids: Iterable[str], now: float
    ) -> dict[str, WorkerMatch]:
        """Each worker's longest prefix of ``block_hashes`` held in any tier (or predicted
        by an unexpired speculative entry), as :class:`WorkerMatch`."""
        self.expire(now)
        result: dict[str, WorkerMatch] = {}
        for worker_id in worker_ids:
            slot = self._slots.get(worker_id)
            shift = 0 if slot is None else slot * len(TIERS)
            pending = self._speculative.get(worker_id, {})
            by_tier = dict.fromkeys(TIERS, 0)
            speculative = 0
            for block_hash in block_hashes:
                tiers = 0 if slot is None else (self._holders.get(block_hash, 0) >> shift) & _TIERS
                if tiers:
                    by_tier[_FASTEST[tiers]] += 1
                elif block_hash in pending:
                    speculative += 1
                else:
                    break
            result[worker_id] = WorkerMatch(by_tier, speculative)
        return result


_TIERS = (1 << len(TIERS)) - 1  # one worker's bits
_FASTEST = tuple(TIERS[(m & -m).bit_length() - 1] if m else "" for m in range(_TIERS + 1))


def _bit(slot: int, tier: str) -> int:
    return 1 << (slot * len(TIERS) + TIERS.index(tier))
