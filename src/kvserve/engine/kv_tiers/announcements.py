"""The storage tier's KV events: what this worker's completed writes put in the store.

Completed writes are announced on the engine thread (``stored``, tier ``storage``), and
keys the store evicted to make room are withdrawn (``removed``). The announced blocks
are remembered, oldest first and bounded, as the snapshot's storage tier, so that a
snapshot plus later events equals a replay of the whole event log: a shared store
cannot be listed per worker, and the router's index holds exactly that from the events.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from kvserve.core.kv_events import EventLog
from kvserve.engine.kv_offload import FaultLog
from kvserve.engine.kv_tiers.storage_writes import MAX_STORED_HASHES, StorageWrites


class StorageAnnouncements:
    def __init__(self, writes: StorageWrites, faults: FaultLog, events: EventLog) -> None:
        self._writes = writes
        self._faults = faults
        self._events = events
        self._announced: dict[int, int | None] = {}  # hash -> parent hash, oldest first
        self._faults_seen = 0

    def announce(self) -> None:
        """Emit the events of the writes completed since the last call."""
        faults = sum(self._faults.snapshot().values())
        if faults != self._faults_seen:
            self._faults_seen = faults
            self._writes.forget_all()
        done = self._writes.writer.done
        while not done.empty():
            write = done.get_nowait()
            if not write.ok:
                self._writes.forget(write.hashes)  # may be tried again
                continue
            self._events.append("stored", "storage", write.hashes, write.parent_hash)
            self._remember(write.hashes, write.parent_hash)
            if write.evicted:
                self._writes.forget(write.evicted)
                self._withdraw(write.evicted)

    def snapshot(self) -> list[tuple[int, int | None]]:
        return list(self._announced.items())

    def _remember(self, hashes: Sequence[int], parent_hash: int | None) -> None:
        announced = self._announced
        for block_hash in hashes:
            announced.pop(block_hash, None)  # rewritten: now the newest
            announced[block_hash] = parent_hash
            parent_hash = block_hash
        overflow = len(announced) - MAX_STORED_HASHES
        if overflow > 0:
            # Bounded memory: the router is told this worker no longer vouches for the
            # oldest ones (they may still be loadable; under-reporting is only a missed hit).
            self._withdraw(list(islice(announced, overflow)))

    def _withdraw(self, hashes: Sequence[int]) -> None:
        for block_hash in hashes:
            self._announced.pop(block_hash, None)
        self._events.append("removed", "storage", hashes)
