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
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import filterfalse, islice, takewhile

from kvserve.core.invariants import require
from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.shared_stores import SharedStore
from kvserve.core.routing.speculative_masks import SHARD_MASK, SpeculativeMasks

TIERS: tuple[str, ...] = ("device", "host", "storage")  # fastest first
# A walk of the prompt follows the workers still matching each on its own (a few passes
# in C per worker, ~2.5 µs, though most leave the match soon, which one mask drops at
# once) once this many blocks or more are left per worker, else as one mask (~0.2 µs a
# block for all of them): measured on routing_scale.py's fleets, 12 made 10 workers
# holding a system prompt each walk alone, slower than the mask
RUN_BLOCKS = 32
SPECULATIVE_TIER = "device"  # where a routed request's blocks will be computed


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    """A worker's longest held prefix of a request's blocks, split by the tier it is in.

    Each block counts in its fastest tier; a block predicted from recent routing, not
    reported yet, counts in :data:`SPECULATIVE_TIER` (where it is being computed).
    """

    blocks_by_tier: dict[str, int]

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks_by_tier.values())


class SlotSet:
    """Workers given as the first bits of their slots in one mask: membership is a shift,
    so a group of thousands is tested without being listed."""

    __slots__ = ("_bits", "_slots")

    def __init__(self, first_bits: int, slots: Mapping[str, int]) -> None:
        self._bits, self._slots = first_bits, slots

    def __contains__(self, worker_id: object) -> bool:
        slot = self._slots.get(worker_id)  # type: ignore[call-overload]
        return slot is not None and bool(self._bits >> (slot * len(TIERS)) & 1)

    def __len__(self) -> int:
        return self._bits.bit_count()


@dataclass(frozen=True, slots=True)
class HolderGroups:
    """The holders of a prompt's prefix, as :meth:`KVBlockIndex.holder_groups` finds them.

    ``shared``: each :class:`WorkerMatch` that several workers share, with the mask of
    their slots' first bits: one per depth matched on device (or speculatively), and one
    per depth a shared store continues (:mod:`~kvserve.core.routing.shared_stores`);
    ``apart``: the holders with a host or storage block of their own, each with its own
    match; ``every``: all of them.
    """

    shared: list[tuple[WorkerMatch, int]]
    apart: dict[str, WorkerMatch]
    every: SlotSet


class KVBlockIndex:
    """Block hash → workers holding it (and in which tiers), plus speculative entries.

    Who holds a block is one int per hash: bit ``slot × len(TIERS) + tier`` for each
    worker slot and tier. A dict and a set per hash made a fleet's index hundreds of
    thousands of objects for CPython's cyclic collector to walk, each full collection a
    pause of the router's event loop; a dict of ints to ints is never tracked by the
    collector. Measured on 8 workers × 32,768 blocks: 534k tracked objects → 10k, a full
    collection 89 ms → 11 ms, a match of 375 blocks on 8 workers 0.19 ms → 0.05 ms.

    A mask is as wide as the highest slot holding the block: 375 bytes at 1,000 workers
    for a block on worker 999 alone, though most blocks have one holder. A block with
    one (slot, tier) is stored as ``~bit_index`` instead (a negative int, one object per
    bit index, shared: see :func:`_compact`); :func:`_mask` widens it where a mask is
    needed.

    ``max_entries`` bounds the (block, holder) entries: past it, the blocks least
    recently stored or matched are forgotten, every holder at once, and counted in
    ``evicted_entries``. A forgotten block only makes the index under-report a prefix
    (its holders look colder than they are), never over-report one.

    Workers that load from one store (:meth:`set_store`) share what any of them
    announced in its storage tier: see :mod:`~kvserve.core.routing.shared_stores`.
    """

    def __init__(self, max_entries: int | None = None) -> None:
        if max_entries is not None and max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._slots: dict[str, int] = {}  # worker -> its bit group in the masks
        self._slot_workers: list[str | None] = []  # slot -> worker (None: free)
        self._free_slots: list[int] = []  # of removed workers, all their bits cleared
        self._first_bits = 0  # the lowest bit of every slot's group, for collapsing tiers
        self._holders: dict[int, int] = {}  # hash -> mask of (worker slot, tier) bits
        # (worker, tier) -> hashes, so that ``cleared`` and worker removal are O(held);
        # each a dict of hash -> None rather than a set: a set is always tracked by the
        # cyclic collector, and a full collection walked every entry of every worker's
        # (175 ms at 1,000 workers x 10^4 blocks, seconds at 10^5), while a dict of ints
        # is never tracked
        self._held: dict[tuple[str, str], dict[int, None]] = {}
        # worker -> hash -> deadline; the heap orders deadlines for cleanup
        self._speculative: dict[str, dict[int, float]] = {}
        self._speculative_holders = SpeculativeMasks()  # hash -> first bits of its workers
        # (deadline, worker, batch), soonest first; a batch: the blocks one call speculated
        # (kept apart from the heap: tuples of atomic values only, which the collector
        # stops tracking), as a dict of hash -> deadline, which the collector never
        # tracks: a tuple of 128 hashes is tracked until a collection has walked its 128
        # items, and a few hundred of them made each young collection 300-600 µs
        self._deadlines: list[tuple[float, str, int]] = []
        self._batches: dict[int, dict[int, float]] = {}
        self._next_batch = 0
        self.num_entries = 0  # (block, worker, tier) bits set
        self.evicted_entries = 0
        self._max_entries = max_entries
        # hash -> None, least recently stored or matched first (only under a budget)
        self._recency: OrderedDict[int, None] | None = (
            OrderedDict() if max_entries is not None else None
        )
        self._store_of: dict[str, str] = {}  # worker -> the store it loads from
        self._stores: dict[str, SharedStore] = {}
        self._store_bits = 0  # every member's storage bit: dropping one unvouches
        self._shared: list[SharedStore] = []  # the stores of two members or more

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

    def set_store(self, worker_id: str, store_id: str | None) -> None:
        """``worker_id`` loads from the store named ``store_id`` (None: from no store
        another worker writes): every block a member announced in its storage tier is
        then in this worker's match too, where its own match ends."""
        old = self._store_of.get(worker_id)
        if old == store_id:
            return
        slot = self._slot(worker_id)
        first, storage = _bit(slot, "device"), _bit(slot, "storage")
        held = self._held.get((worker_id, "storage"), {})
        if old is not None:
            store = self._stores[old]
            store.leave(first, storage, held)
            if not store.members:
                del self._stores[old]
            del self._store_of[worker_id]
        if store_id is not None:
            self._stores.setdefault(store_id, SharedStore()).join(first, storage, held)
            self._store_of[worker_id] = store_id
        self._store_bits = 0
        for store in self._stores.values():
            self._store_bits |= store.storage_bits
        self._shared = [store for store in self._stores.values() if store.members > 1]

    @property
    def num_workers(self) -> int:
        """Workers with a slot: every worker a policy was told of, or learnt from loads."""
        return len(self._slots)

    def store_of(self, worker_id: str) -> str | None:
        return self._store_of.get(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker that left the fleet, speculation included."""
        self.set_store(worker_id, None)
        for tier in [t for w, t in self._held if w == worker_id]:
            self._clear(worker_id, tier)
        slot = self._slots.pop(worker_id, None)
        pending = self._speculative.pop(worker_id, {})
        if slot is not None:
            self._speculative_holders.drop_all(pending, _bit(slot, "device"))
            self._slot_workers[slot] = None
            self._free_slots.append(slot)

    def num_blocks(self, worker_id: str, tier: str = "device") -> int:
        return len(self._held.get((worker_id, tier), ()))

    def holds(self, worker_id: str, block_hash: int, tier: str = "device") -> bool:
        slot = self._slots.get(worker_id)
        if slot is None:
            return False
        return bool(_mask(self._holders.get(block_hash, 0)) & _bit(slot, tier))

    def slot(self, worker_id: str) -> int:
        """``worker_id``'s slot: its bits in the masks start at ``slot × len(TIERS)``
        (given one if it had none)."""
        return self._slot(worker_id)

    def _slot(self, worker_id: str) -> int:
        slot = self._slots.get(worker_id)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._slot_workers[slot] = worker_id
            else:
                slot = len(self._slot_workers)
                self._slot_workers.append(worker_id)
                self._first_bits |= _bit(slot, "device")
            self._slots[worker_id] = slot
        return slot

    def _store(self, worker_id: str, tier: str, block_hashes: Iterable[int]) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown KV tier {tier!r}; expected one of {TIERS}")
        bit = _bit(self._slot(worker_id), tier)
        holders = self._holders
        held = self._held.setdefault((worker_id, tier), {})
        store = self._stores[self._store_of[worker_id]] if bit & self._store_bits else None
        pending = self._speculative.get(worker_id)
        confirmed: list[int] = []  # speculated here, now reported: the event replaces the guess
        recency = self._recency
        for block_hash in block_hashes:
            mask = _mask(holders.get(block_hash, 0))
            if not mask & bit:
                holders[block_hash] = _compact(mask | bit)
                self.num_entries += 1
                if store is not None:
                    store.vouch(block_hash)
            held[block_hash] = None
            if recency is not None:
                recency[block_hash] = None
                recency.move_to_end(block_hash)
            if pending and pending.pop(block_hash, None) is not None:
                confirmed.append(block_hash)
        if confirmed:
            self._speculative_holders.drop_all(confirmed, _bit(self._slots[worker_id], "device"))
        self._enforce_budget()

    def _enforce_budget(self) -> None:
        """Forget the least recently stored or matched blocks until within budget."""
        if self._recency is None or self._max_entries is None:
            return
        while self.num_entries > self._max_entries and self._recency:
            block_hash, _ = self._recency.popitem(last=False)
            mask = _mask(self._holders.pop(block_hash, 0))
            evicted = mask.bit_count()
            self.num_entries -= evicted
            self.evicted_entries += evicted
            if mask & self._store_bits:
                for store in self._stores.values():
                    store.vouched.pop(block_hash, None)
            while mask:
                low = mask & -mask
                slot, tier = divmod(low.bit_length() - 1, len(TIERS))
                worker_id = self._slot_workers[slot]
                assert worker_id is not None, "a free slot holds no bits"
                self._held[(worker_id, TIERS[tier])].pop(block_hash, None)
                mask ^= low

    def _remove(self, worker_id: str, tier: str, block_hashes: Iterable[int]) -> None:
        store_id = self._store_of.get(worker_id) if tier == "storage" else None
        if store_id is not None:
            self._remove_from_store(self._stores[store_id], block_hashes)
            return
        held = self._held.get((worker_id, tier))
        if held is None:
            return
        bit = _bit(self._slots[worker_id], tier)
        for block_hash in block_hashes:
            if block_hash in held:
                del held[block_hash]
                self._drop_bit(block_hash, bit)

    def _remove_from_store(self, store: SharedStore, block_hashes: Iterable[int]) -> None:
        """A member's store evicted these blocks: no member has them any more, whichever
        of them announced them (a member withdrawing a block it no longer vouches for,
        which may still be stored, only makes the others look colder)."""
        for block_hash in block_hashes:
            mask = _mask(self._holders.get(block_hash, 0)) & store.storage_bits
            while mask:
                low = mask & -mask
                worker_id = self._slot_workers[(low.bit_length() - 1) // len(TIERS)]
                assert worker_id is not None, "a free slot holds no bits"
                del self._held[(worker_id, "storage")][block_hash]
                self._drop_bit(block_hash, low)
                mask ^= low

    def _clear(self, worker_id: str, tier: str) -> None:
        held = self._held.pop((worker_id, tier), ())
        if held:
            bit = _bit(self._slots[worker_id], tier)
            for block_hash in held:
                self._drop_bit(block_hash, bit)

    def _drop_bit(self, block_hash: int, bit: int) -> None:
        mask = _mask(self._holders[block_hash]) & ~bit
        self.num_entries -= 1
        if bit & self._store_bits:
            for store in self._stores.values():
                if bit & store.storage_bits:
                    store.unvouch(block_hash)
        if mask:
            self._holders[block_hash] = _compact(mask)
        else:
            del self._holders[block_hash]
            if self._recency is not None:
                self._recency.pop(block_hash, None)

    def check(self) -> None:
        """Raise :class:`~kvserve.core.invariants.InvariantError` unless the masks, the
        per-(worker, tier) records and each shared store's counts agree (tests)."""
        entries = 0
        for (worker_id, tier), held in self._held.items():
            bit = _bit(self._slots[worker_id], tier)
            for block_hash in held:
                require(
                    bool(_mask(self._holders.get(block_hash, 0)) & bit), "a record without its bit"
                )
            entries += len(held)
        masks = sum(_mask(stored).bit_count() for stored in self._holders.values())
        require(entries == masks == self.num_entries, "the entry count is off")
        for store_id, store in self._stores.items():
            members = [w for w, s in self._store_of.items() if s == store_id]
            require(len(members) == store.members > 0, "a store's member count is off")
            counts: dict[int, int] = {}
            first = storage = 0
            for worker_id in members:
                slot = self._slots[worker_id]
                first |= _bit(slot, "device")
                storage |= _bit(slot, "storage")
                for block_hash in self._held.get((worker_id, "storage"), ()):
                    counts[block_hash] = counts.get(block_hash, 0) + 1
            require((first, storage) == (store.first_bits, store.storage_bits), "member bits")
            require(counts == store.vouched, "a store's vouched blocks are not its members'")

    # ---------------------------------------------------------------- speculation

    def speculate(self, worker_id: str, block_hashes: Sequence[int], deadline: float) -> None:
        """Predict that ``worker_id`` will hold these blocks; forgotten after ``deadline``
        unless a ``stored`` event confirms them first. One deadline entry per call, not
        per block: a 128-block prompt is one heap push."""
        pending = self._speculative.get(worker_id)
        if pending is None:
            pending = self._speculative[worker_id] = {}
        bit = _bit(self._slot(worker_id), "device")
        # not confirmed on device: its device set is the bit's other record
        confirmed = self._held.get((worker_id, "device"), ())
        fresh = dict.fromkeys(filterfalse(confirmed.__contains__, block_hashes), deadline)
        if fresh:
            # the masks already hold the bit of every hash pending here: a burst sharing
            # a prefix speculates it again on the same worker, renewing deadlines only
            added = list(filterfalse(pending.__contains__, fresh))
            pending.update(fresh)
            if added:
                self._speculative_holders.add(added, bit)
            batch = self._next_batch
            self._next_batch += 1
            self._batches[batch] = fresh
            heapq.heappush(self._deadlines, (deadline, worker_id, batch))

    def withdraw(self, worker_id: str, block_hashes: Sequence[int], deadline: float) -> None:
        """Take back ``speculate(worker_id, block_hashes, deadline)``: the entries it set
        and no later speculation renewed go at once (confirmed ones are not speculative)."""
        pending = self._speculative.get(worker_id)
        slot = self._slots.get(worker_id)
        if not pending or slot is None:
            return
        taken: list[int] = []
        for block_hash in block_hashes:  # a prompt may repeat a hash: each taken once
            if pending.get(block_hash) == deadline:
                del pending[block_hash]
                taken.append(block_hash)
        self._speculative_holders.drop_all(taken, _bit(slot, "device"))

    def expire(self, now: float) -> int:
        """Drop speculative entries whose deadline passed; returns how many."""
        dropped = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, worker_id, batch = heapq.heappop(self._deadlines)
            speculated = self._batches.pop(batch)  # hash -> the batch's deadline
            pending = self._speculative.get(worker_id)
            if not pending:
                continue
            # the batch's entries no later speculation renewed, found in C: most of a
            # long prompt's are renewed where a burst or a conversation returns to it
            # (an intersection of the item views: 3 % fewer instructions per 128-block
            # decision than a compress over deadlines compared through a method wrapper)
            due = [block_hash for block_hash, _ in speculated.items() & pending.items()]
            for block_hash in due:
                del pending[block_hash]
            self._speculative_holders.drop_all(due, _bit(self._slots[worker_id], "device"))
            dropped += len(due)
        return dropped

    def num_speculative(self, worker_id: str) -> int:
        return len(self._speculative.get(worker_id, ()))

    # ---------------------------------------------------------------- queries

    def match(
        self, block_hashes: Sequence[int], worker_ids: Iterable[str], now: float
    ) -> dict[str, WorkerMatch]:
        """Each worker's longest prefix of ``block_hashes`` held in any tier (or predicted
        by an unexpired speculative entry, or continued by its shared store), as
        :class:`WorkerMatch`: one walk per worker, the reference that
        :meth:`match_holders` must agree with."""
        self.expire(now)
        return {w: self._walk_with_store(w, block_hashes) for w in worker_ids}

    def _walk_with_store(self, worker_id: str, block_hashes: Sequence[int]) -> WorkerMatch:
        """``worker_id``'s own match, then its store's run of the blocks after it."""
        end = len(block_hashes)
        match = self._walk(worker_id, block_hashes, end)
        store_id = self._store_of.get(worker_id)
        if store_id is None:
            return match
        return _loading(match, self._stores[store_id].run(block_hashes, match.num_blocks, end))

    def match_holders(self, block_hashes: Sequence[int], now: float) -> dict[str, WorkerMatch]:
        """:meth:`match` for every worker whose match is not empty: :meth:`holder_groups`,
        each group's members listed."""
        groups = self.holder_groups(block_hashes, now)
        result = dict(groups.apart)
        for match, members in groups.shared:
            for worker_id in self.members(members):
                result[worker_id] = match
        return result

    def holder_layers(
        self, block_hashes: Sequence[int], now: float
    ) -> tuple[list[tuple[int, bytes]], list[tuple[WorkerMatch, bytes]], dict[str, WorkerMatch]]:
        """:meth:`holder_groups` for a fleet predicted whole, as its scoring reads it:
        (matched blocks, members) per depth for the holders whose match is all on device
        (or speculative), the members as the mask's bytes (little-endian, as long as
        every slot's: slot ``s`` is in iff ``members[3s >> 3] >> (3s & 7) & 1``); the
        same, with their match, for the groups a shared store continues; and the other
        holders' matches split by tier, by worker. A worker is then found in its layer
        by a byte lookup: listing a popular prefix's holders bit by bit cost more than
        the rest of a 100-worker decision."""
        depths, stored, apart = self._split_by_tier(block_hashes, now)
        width = (self._first_bits.bit_length() + 7) // 8
        layers = [
            (matched, on_device.to_bytes(width, "little"))
            for matched, _, on_device in depths
            if on_device
        ]
        loading = [(match, members.to_bytes(width, "little")) for match, members in stored]
        return layers, loading, apart

    def holder_groups(self, block_hashes: Sequence[int], now: float) -> HolderGroups:
        """Every worker whose match is not empty, in one walk of the prompt whatever the
        fleet's size, its holders left as masks rather than listed.

        The walk carries the set of workers still matching as one int (a bit per worker);
        a block narrows it with two mask operations, and the workers it drops have their
        depth: one mask per depth, never a step per worker. A worker whose matched blocks
        are all on device (or speculative) is done then; the few with a host or storage
        block in their prefix are walked once more alone for the split by tier. A shared
        store's members are then matched further where the store continues their match.
        """
        depths, stored, apart = self._split_by_tier(block_hashes, now)
        groups: list[tuple[WorkerMatch, int]] = []
        every = 0
        for matched, members, on_device in depths:
            every |= members
            if on_device:
                groups.append(
                    (WorkerMatch({"device": matched, "host": 0, "storage": 0}), on_device)
                )
        for group in stored:
            every |= group[1]
            groups.append(group)
        return HolderGroups(groups, apart, SlotSet(every, self._slots))

    def _split_by_tier(
        self, block_hashes: Sequence[int], now: float
    ) -> tuple[list[tuple[int, int, int]], list[tuple[WorkerMatch, int]], dict[str, WorkerMatch]]:
        """The walk after expiring speculation: (matched blocks, first bits of the
        holders matched that deep, those of them whose match is all on device and not
        continued by a shared store) per depth; the groups a shared store continues
        (:meth:`_through_stores`); and the others' matches split by tier (each walked
        once more alone)."""
        self.expire(now)
        by_depth, off_device = self._depths(block_hashes)
        depths: list[tuple[int, int, int]] = []
        apart: dict[str, WorkerMatch] = {}
        for matched, members in by_depth:
            walked = members & off_device
            if walked:
                for worker_id in self.members(walked):
                    apart[worker_id] = self._walk(worker_id, block_hashes, matched)
            depths.append((matched, members, members & ~off_device))
        stored = self._through_stores(block_hashes, depths, apart) if self._shared else []
        return depths, stored, apart

    def _through_stores(
        self,
        block_hashes: Sequence[int],
        depths: list[tuple[int, int, int]],
        apart: dict[str, WorkerMatch],
    ) -> list[tuple[WorkerMatch, int]]:
        """Each shared store's members whose own match the store's blocks continue: one
        group per depth of those matched on device (taken out of that depth's), one of
        the members that match nothing of their own, and those ``apart`` extended in
        place. A store's run is found once per depth, not per member."""
        end = len(block_hashes)
        slots = self._slots
        groups: list[tuple[WorkerMatch, int]] = []
        for store in self._shared:
            members = store.first_bits
            holding = 0
            for i, (matched, holders, on_device) in enumerate(depths):
                holding |= holders & members
                continued = on_device & members
                if continued:
                    loaded = store.run(block_hashes, matched, end)
                    if loaded:
                        depths[i] = (matched, holders, on_device & ~continued)
                        device = {"device": matched, "host": 0, "storage": loaded}
                        groups.append((WorkerMatch(device), continued))
            for worker_id, match in apart.items():
                if members >> (slots[worker_id] * len(TIERS)) & 1:
                    apart[worker_id] = _loading(
                        match, store.run(block_hashes, match.num_blocks, end)
                    )
            cold = members & ~holding
            loaded = store.run(block_hashes, 0, end) if cold else 0
            if loaded:
                groups.append((WorkerMatch({"device": 0, "host": 0, "storage": loaded}), cold))
        return groups

    def _depths(self, block_hashes: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
        """The walk of :meth:`holder_groups`: (matched blocks, first bits of the workers
        matching that many) per depth, and the first bits of the workers with a host or
        storage block in their prefix. Once ``RUN_BLOCKS`` blocks or more are left per
        worker still matching, each one's match is found from its own sets
        (:meth:`_run`), in C: a conversation's own prefix, the bulk of a long prompt,
        costs no Python step per block."""
        holders, first = self._holders, self._first_bits
        apart = first << 1 | first << 2  # every slot's host and storage bits
        speculative = self._speculative_holders.shards
        by_depth: list[tuple[int, int]] = []  # (matched blocks, first bits of its workers)
        alive = -1  # every slot, until the first block narrows it
        off_device = 0  # slots with a block found in host or storage only
        recency = self._recency
        end = len(block_hashes)
        for depth, block_hash in enumerate(block_hashes):
            mask = holders.get(block_hash, 0)
            if mask < 0:
                mask = 1 << ~mask
            if mask & apart:  # a host or storage copy: each slot's tiers to its first bit
                reported = (mask | mask >> 1 | mask >> 2) & first
                elsewhere = reported & ~mask  # slots holding it off device only
            else:  # on device only (most blocks): the mask is its first bits already
                reported, elsewhere = mask, 0
            here = reported | speculative[block_hash & SHARD_MASK].get(block_hash, 0)
            if alive == -1:
                alive = here
                left = alive.bit_count() if recency is None else end  # recency: by block
            else:
                dropped = alive & ~here
                if dropped:
                    by_depth.append((depth, dropped))
                    alive &= here
                    left = alive.bit_count() if recency is None else end  # recency: by block
            if not alive:
                break
            if elsewhere:
                off_device |= alive & elsewhere
            if recency is not None and mask:
                recency.move_to_end(block_hash)
            if left * RUN_BLOCKS <= end - depth:  # the rest worker by worker
                ends: dict[int, int] = {}
                for bit in _bits(alive):
                    matched, off = self._run(bit, block_hashes, depth + 1)
                    ends[matched] = ends.get(matched, 0) | bit
                    off_device |= off
                by_depth += sorted(ends.items()) if len(ends) > 1 else ends.items()
                return by_depth, off_device
        else:
            if alive not in (0, -1):
                by_depth.append((len(block_hashes), alive))
        return by_depth, off_device

    def _run(self, first_bit: int, block_hashes: Sequence[int], depth: int) -> tuple[int, int]:
        """How many of ``block_hashes`` the worker of ``first_bit`` matches, walked on
        from ``depth`` (the blocks before it matched), and ``first_bit`` if a block of
        its match is in host or storage but not on device (else 0): runs of its blocks
        on device, then of its speculative ones, each passed over in C."""
        worker_id = self._slot_workers[(first_bit.bit_length() - 1) // len(TIERS)]
        assert worker_id is not None, "a free slot holds no bits"
        on_device = self._held.get((worker_id, "device"), ())
        off, end = 0, len(block_hashes)
        elsewhere: list[dict[int, None]] | None = None  # its host and storage blocks, if needed
        while True:
            depth += _run_length(on_device.__contains__, block_hashes, depth)
            if depth == end:
                return depth, off
            pending = self._speculative.get(worker_id, {})
            block_hash = block_hashes[depth]
            if elsewhere is None:
                held = self._held
                elsewhere = [held[(worker_id, t)] for t in TIERS[1:] if (worker_id, t) in held]
            if any(block_hash in blocks for blocks in elsewhere):
                off = first_bit
                depth += 1
            elif block_hash in pending:
                length = _run_length(pending.__contains__, block_hashes, depth)
                run = block_hashes[depth : depth + length]
                if not all(blocks.keys().isdisjoint(run) for blocks in elsewhere):
                    off = first_bit
                depth += length
            else:
                return depth, off

    def members(self, first_bits: int) -> list[str]:
        """The workers whose slot's first bit is set in ``first_bits``."""
        workers = self._slot_workers
        found: list[str] = []
        while first_bits:
            low = first_bits & -first_bits
            worker_id = workers[(low.bit_length() - 1) // len(TIERS)]
            assert worker_id is not None, "a free slot holds no bits"
            found.append(worker_id)
            first_bits ^= low
        return found

    def _walk(self, worker_id: str, block_hashes: Sequence[int], limit: int) -> WorkerMatch:
        """``worker_id``'s match, block by block, among the first ``limit`` blocks."""
        slot = self._slots.get(worker_id)
        shift = 0 if slot is None else slot * len(TIERS)
        pending = self._speculative.get(worker_id, {})
        by_tier = dict.fromkeys(TIERS, 0)
        for block_hash in block_hashes[:limit]:
            mask = _mask(self._holders.get(block_hash, 0))
            tiers = 0 if slot is None else (mask >> shift) & _TIERS
            if tiers:
                by_tier[_FASTEST[tiers]] += 1
            elif block_hash in pending:
                by_tier[SPECULATIVE_TIER] += 1
            else:
                break
        return WorkerMatch(by_tier)


def _loading(match: WorkerMatch, blocks: int) -> WorkerMatch:
    """``match`` continued by ``blocks`` loaded from storage."""
    if not blocks:
        return match
    by_tier = dict(match.blocks_by_tier)
    by_tier["storage"] = by_tier.get("storage", 0) + blocks
    return WorkerMatch(by_tier)


_TIERS = (1 << len(TIERS)) - 1  # one worker's bits
_FASTEST = tuple(TIERS[(m & -m).bit_length() - 1] if m else "" for m in range(_TIERS + 1))


def _bits(first_bits: int) -> Iterator[int]:
    """Each set bit of ``first_bits``, lowest first."""
    while first_bits:
        low = first_bits & -first_bits
        yield low
        first_bits ^= low


def _run_length(held: Callable[[int], bool], block_hashes: Sequence[int], start: int) -> int:
    """How many of ``block_hashes`` from ``start`` on are ``held`` in a row, counted in C."""
    return len(list(takewhile(held, islice(block_hashes, start, None))))


def _mask(stored: int) -> int:
    """The holders' mask of a stored value (``~i``: the one bit ``i``)."""
    return stored if stored >= 0 else 1 << ~stored


# ``~i`` for each bit index ``i`` stored so far, one int object per bit: every block that
# one (slot, tier) holds alone refers to it. An int made per block was 28 bytes of each
# such entry's ~150 (at 1,000 workers), and the walk's read of it a cache miss of its own
# once the index outgrows the caches.
_LONE_BITS: list[int] = []


def _compact(mask: int) -> int:
    """What to store for ``mask`` (non-zero): one bit as ``~its_index`` (shared)."""
    if mask & (mask - 1):
        return mask
    index = mask.bit_length() - 1
    if index >= len(_LONE_BITS):
        _LONE_BITS.extend(~i for i in range(len(_LONE_BITS), index + 1))
    return _LONE_BITS[index]


def _bit(slot: int, tier: str) -> int:
    return 1 << (slot * len(TIERS) + TIERS.index(tier))
