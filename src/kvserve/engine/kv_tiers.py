"""KV tiers below the device pool: host memory, then a storage tier shared by workers.

The engine calls three hooks, the scheduler asks one question and tells one event, all
on the engine's thread:

- **Admission** (:meth:`KVTiers.admission_gate`, asked by the scheduler before it
  admits a waiting request). The request's blocks are looked up device first, then
  host, then storage, as a longest prefix. Host blocks are copied at once into freshly
  allocated device blocks; if the storage tier may hold more, the request is held back
  (later requests go ahead) while the loader thread looks and reads.
- **Before a step**: finished loads are installed, storage writes that completed are
  announced, and requests admitted since the last step let go of the pins that kept
  their loaded blocks alive until then.
- **On preemption** (the scheduler tells, before it frees the victim's blocks): what the
  request computed is copied out for storage, so that on resume it loads instead of
  recomputing.
- **After a step**: blocks the step completed go to the host tier (write-through) and,
  by the write policy, to storage (``write_through``, or ``hit_count:K`` once a block
  was found in device or host memory by K admissions).

Installs are fenced by ownership: blocks are allocated to a holder of their own
(``tier-load:<request id>``), written while still owned (no request can read them, the
allocator cannot reuse them), then published and kept pinned until the request is
admitted. A storage value is verified (checksum, key, layout) before it is installed;
any failure is a miss, counted and logged once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Literal

import torch

from kvserve.core.kv_events import EventLog
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.host_kv_pool import HostKVPool
from kvserve.engine.kv_block_io import KVBlockLayout, read_blocks, write_blocks
from kvserve.engine.kv_offload import (
    FaultLog,
    LoadJob,
    LoadResult,
    StorageLoader,
    StorageWriter,
    WriteJob,
)
from kvserve.engine.kv_pool import KVPool
from kvserve.engine.kv_tier_config import KVTierConfig
from kvserve.engine.storage.base import KVStorage, open_storage
from kvserve.engine.storage.block_codec import namespace_of

# While the only waiting work is loads, the engine thread waits this long for one to
# finish instead of spinning through empty steps.
_IDLE_WAIT_S = 0.02
_MAX_HIT_COUNTS = 1 << 16  # hashes whose hits are counted for hit_count:K (LRU)
_MAX_STORED_HASHES = 1 << 20  # hashes remembered as written by this worker
FAULT_PREFIX = "fault_"  # metrics() names of fault counts: fault_read, fault_write, ...
GAUGES = frozenset({"host_blocks", "host_capacity_blocks"})  # the rest of metrics() count

InstallOutcome = Literal["installed", "nothing", "no_room", "gap"]
Fetch = Callable[[int, int], torch.Tensor]  # (i, j) -> CPU copy of blocks i..j of a chain


@dataclass(slots=True)
class TierStats:
    """Exact, cumulative counters (tokens are block tokens)."""

    host_hit_tokens: int = 0  # installed from host memory
    storage_hit_tokens: int = 0  # installed from the storage tier
    storage_lookups: int = 0  # admissions that asked the storage tier
    loads_without_room: int = 0  # admitted before loaded blocks could be installed
    resumed_reused_tokens: int = 0  # of preempted requests: not recomputed on resume
    resumed_loaded_tokens: int = 0  # of those, loaded from host or storage
    resumed_recomputed_tokens: int = 0  # computed before preemption, computed again


@dataclass(slots=True)
class _Admission:
    """A waiting request the tiers looked at: loading, or loaded and pinned for it."""

    request: Request
    loading: bool = False  # the loader thread is looking it up in storage
    loaded: LoadResult | None = None  # storage blocks read, not installed yet
    installed: bool = False  # found blocks are in the device cache, pinned for it
    loaded_tokens: int = 0


@dataclass(slots=True)
class _Progress:
    """A running request's blocks already offered to the tiers."""

    request: Request
    offered_blocks: int = 0


def _holder(request_id: str) -> str:
    """The KV cache holder of blocks loaded for a request, beside the request itself."""
    return f"tier-load:{request_id}"


class KVTiers:
    """The host and storage tiers of one engine, and the hooks that move blocks."""

    def __init__(
        self,
        scheduler: Scheduler,
        pool: KVPool,
        layout: KVBlockLayout,
        events: EventLog,
        config: KVTierConfig,
    ) -> None:
        self._scheduler = scheduler
        self._cache = scheduler.kv_cache
        self._block_size = self._cache.block_size
        self._pool = pool
        self._layout = layout
        self._events = events
        self._min_hits = config.min_hits
        host_blocks = config.host_blocks_for(layout.block_nbytes)
        self.host = HostKVPool(layout, host_blocks, events) if host_blocks else None
        self.faults = FaultLog()
        self.stats = TierStats()
        self._storage: KVStorage | None = None
        self._writer: StorageWriter | None = None
        self._loader: StorageLoader | None = None
        if config.storage:
            self._storage = open_storage(
                config.storage, namespace_of(layout), max_bytes=config.storage_max_bytes
            )
            self._writer = StorageWriter(
                self._storage, layout, self.faults, config.max_pending_writes
            )
            self._loader = StorageLoader(self._storage, layout, self.faults)
        self._admissions: dict[str, _Admission] = {}
        self._progress: dict[str, _Progress] = {}
        self._resuming: dict[str, int] = {}  # preempted request -> tokens it had computed
        self._hits: OrderedDict[int, int] = OrderedDict()
        self._stored: set[int] = set()  # written (or queued) to storage by this worker
        # What this worker's storage events say the store holds (hash -> parent hash),
        # oldest first: the snapshot's storage tier, so that snapshot + later events
        # equals a replay of the whole event log.
        self._announced: dict[int, int | None] = {}
        self._faults_seen = 0
        scheduler.admission_gate = self.admission_gate
        scheduler.on_preempt = self.save_preempted

    # ---------------------------------------------------------------- admission

    def admission_gate(self, request: Request) -> bool:
        """May the scheduler admit ``request`` now? False while its blocks load.

        Found blocks are installed here, when the scheduler is about to admit the request
        (and so to need the device blocks anyway); an install that finds no room is tried
        again at the next admission attempt.
        """
        admission = self._admissions.get(request.request_id)
        if admission is None:
            hashes = request.reusable_block_hashes()
            in_device, found = self._look_up(hashes)
            needs_storage = self._loader is not None and found < len(hashes)
            if not needs_storage and found == in_device:
                return True  # nothing below the device: asked again next time, if it waits
            admission = self._admissions[request.request_id] = _Admission(request)
            if needs_storage:
                self._load(admission, hashes, found)
        if admission.loading:
            return False
        if not admission.installed:
            hashes = request.reusable_block_hashes()
            outcome = self._install(admission, hashes)
            if outcome == "gap":
                # Device blocks the loaded ones continue were evicted while it waited:
                # look the store up again from where memory now ends.
                self._load(admission, hashes, self._look_up(hashes)[1])
                return False
            admission.installed = outcome == "installed"
        return True

    def _load(self, admission: _Admission, hashes: list[int], start: int) -> None:
        admission.loading = True
        admission.loaded = None
        self.stats.storage_lookups += 1
        assert self._loader is not None
        self._loader.submit(LoadJob(admission.request.request_id, start, tuple(hashes[start:])))

    def _look_up(self, hashes: list[int]) -> tuple[int, int]:
        """How many leading blocks the device holds, and device and host together."""
        in_device = len(self._cache.lookup_prefix(hashes))
        return in_device, in_device + (self.host.prefix_len(hashes, in_device) if self.host else 0)

    def _install(self, admission: _Admission, hashes: list[int]) -> InstallOutcome:
        """Copy the request's blocks found in host memory (and those loaded from storage)
        into new device blocks, publish them, pin them until admission."""
        cache = self._cache
        in_device = len(cache.lookup_prefix(hashes))
        from_host = self.host.prefix_len(hashes, in_device) if self.host else 0
        end = in_device + from_host
        loaded = admission.loaded
        if loaded is not None and loaded.start > end:
            return "gap"
        stored = loaded.blocks[end - loaded.start :] if loaded else None
        from_storage = 0 if stored is None else stored.shape[0]
        total = end + from_storage
        if total == in_device:
            return "nothing"
        if cache.num_available_blocks < total:  # the prefix it pins may count as available
            return "no_room"
        holder = _holder(admission.request.request_id)
        cache.match_prefix(holder, hashes[:in_device])
        if not cache.allocate_slots(holder, total * self._block_size):
            cache.free_request(holder)
            return "no_room"
        table = cache.block_table(holder)
        if from_host:
            assert self.host is not None
            host_blocks = self.host.read(hashes[in_device:end])
            write_blocks(self._pool, self._layout, table[in_device:end], host_blocks)
        if stored is not None and from_storage:
            write_blocks(self._pool, self._layout, table[end:total], stored)
            if self.host is not None:  # loaded once, kept close for the next request
                self.host.store(hashes[end:total], hashes[end - 1] if end else None,
                                lambda i, j: stored[i:j])  # fmt: skip
        cache.commit_blocks(holder, hashes[:total])
        self.stats.host_hit_tokens += from_host * self._block_size
        self.stats.storage_hit_tokens += from_storage * self._block_size
        admission.loaded_tokens = (total - in_device) * self._block_size
        admission.loaded = None
        return "installed"

    # ---------------------------------------------------------------- step hooks

    def before_step(self) -> None:
        if self._writer is not None:
            self._announce_writes()
        if self._loader is not None:
            for result in self._loader.results(self._idle_wait_s()):
                self._finish_load(result)
        for request_id, admission in list(self._admissions.items()):
            if not admission.loading and admission.request.status is not RequestStatus.WAITING:
                self._release(request_id)
        for request_id, progress in list(self._progress.items()):
            if progress.request.is_finished:
                del self._progress[request_id]

    def _idle_wait_s(self) -> float:
        """Wait for a load only when nothing else could run meanwhile."""
        scheduler = self._scheduler
        if scheduler.running or not scheduler.waiting:
            return 0.0
        admissions = self._admissions
        for request in scheduler.waiting:
            admission = admissions.get(request.request_id)
            if admission is None or not admission.loading:
                return 0.0
        return _IDLE_WAIT_S

    def _finish_load(self, result: LoadResult) -> None:
        admission = self._admissions.get(result.request_id)
        if admission is None or not admission.loading:
            return  # aborted while loading
        admission.loading = False
        hashes = admission.request.reusable_block_hashes()
        if tuple(hashes[result.start : result.start + len(result.hashes)]) == result.hashes:
            admission.loaded = result

    def _release(self, request_id: str) -> None:
        admission = self._admissions.pop(request_id)
        self._cache.free_request(_holder(request_id))
        if admission.loaded is not None and admission.loaded.blocks.shape[0]:
            self.stats.loads_without_room += 1

    def save_preempted(self, victim: Request) -> None:
        """The scheduler is preempting ``victim``: its blocks still hold what it computed.
        Copy that out for the storage tier so that its resume loads instead of recomputing.
        """
        self._resuming[victim.request_id] = victim.num_computed_tokens
        if self._writer is not None:
            hashes = victim.computed_block_hashes()
            table = self._cache.block_table(victim.request_id)
            self._write_to_storage(hashes, 0, len(hashes), self._device_fetch(table))

    def after_advance(self, plan: SchedulerOutput) -> None:
        """Offer the blocks this step completed to the host and storage tiers."""
        for chunk in plan.chunks:
            request = chunk.request
            request_id = request.request_id
            progress = self._progress.get(request_id)
            prior = self._resuming.pop(request_id, None)
            if progress is None or prior is not None:  # its first chunk since admission
                if progress is None:
                    progress = self._progress[request_id] = _Progress(request)
                if self._min_hits and self._writer is not None:
                    self._count_hits(request, chunk.start // self._block_size)
            if prior is not None:
                admission = self._admissions.get(request_id)
                if admission is not None:
                    self.stats.resumed_loaded_tokens += admission.loaded_tokens
                reused = min(prior, chunk.start)
                self.stats.resumed_reused_tokens += reused
                self.stats.resumed_recomputed_tokens += prior - reused
            committed = request.num_committed_blocks
            if committed > progress.offered_blocks:
                self._offer(request, progress.offered_blocks, committed)
                progress.offered_blocks = committed

    def _offer(self, request: Request, start: int, end: int) -> None:
        hashes = request.computed_block_hashes()
        table = self._cache.block_table(request.request_id)
        if self.host is not None:
            # From the first block the host lacks: a chain enters only under its parent.
            first = self.host.prefix_len(hashes[:end])
            if first < end:
                parent = hashes[first - 1] if first else None
                self.host.store(hashes[first:end], parent, self._device_fetch(table[first:end]))
        if self._writer is not None and not self._min_hits:
            self._write_to_storage(hashes, start, end, self._device_fetch(table))

    def forget(self, request_id: str) -> None:
        """The request is gone (aborted): drop what the tiers hold for it."""
        if request_id in self._admissions:
            self._release(request_id)
        self._progress.pop(request_id, None)
        self._resuming.pop(request_id, None)

    # ---------------------------------------------------------------- storage writes

    def _device_fetch(self, blocks: Sequence[int]) -> Fetch:
        return lambda i, j: read_blocks(self._pool, self._layout, blocks[i:j])

    def _write_to_storage(self, hashes: Sequence[int], start: int, end: int, fetch: Fetch) -> None:
        """Queue ``hashes[start:end]`` (``fetch(i, j)`` copies out ``hashes[i:j]``) past
        the part this worker already stored; dropped, not waited for, if the writer is
        behind."""
        assert self._writer is not None
        stored = self._stored
        while start < end and hashes[start] in stored:
            start += 1
        if start == end:
            return
        chain = tuple(hashes[start:end])
        job = WriteJob(chain, hashes[start - 1] if start else None, fetch(start, end))
        if self._writer.submit(job):
            if len(stored) >= _MAX_STORED_HASHES:
                stored.clear()  # only costs a rewrite (a touch) of what was written before
            stored.update(chain)

    def _announce_writes(self) -> None:
        assert self._writer is not None
        faults = sum(self.faults.snapshot().values())
        if faults != self._faults_seen:
            # A store that failed may have lost what it held (a restarted server): write
            # blocks again rather than trust this worker's memory of them.
            self._faults_seen = faults
            self._stored.clear()
        done = self._writer.done
        while not done.empty():
            write = done.get_nowait()
            if not write.ok:
                self._stored.difference_update(write.hashes)  # may be tried again
                continue
            self._events.append("stored", "storage", write.hashes, write.parent_hash)
            self._remember_announced(write.hashes, write.parent_hash)
            if write.evicted:
                self._stored.difference_update(write.evicted)
                self._forget_announced(write.evicted)

    def _remember_announced(self, hashes: Sequence[int], parent_hash: int | None) -> None:
        announced = self._announced
        for block_hash in hashes:
            announced.pop(block_hash, None)  # rewritten: now the newest
            announced[block_hash] = parent_hash
            parent_hash = block_hash
        overflow = len(announced) - _MAX_STORED_HASHES
        if overflow > 0:
            # Bounded memory: the router is told this worker no longer vouches for the
            # oldest ones (they may still be loadable; under-reporting is only a missed hit).
            oldest = list(islice(announced, overflow))
            self._forget_announced(oldest)

    def _forget_announced(self, hashes: Sequence[int]) -> None:
        for block_hash in hashes:
            self._announced.pop(block_hash, None)
        self._events.append("removed", "storage", hashes)

    def _count_hits(self, request: Request, num_found: int) -> None:
        """hit_count:K: blocks found by their K-th admission are written to storage."""
        hits = self._hits
        hashes = request.computed_block_hashes()
        promote = 0
        for i in range(num_found):
            count = hits.pop(hashes[i], 0) + 1
            hits[hashes[i]] = count
            if count >= self._min_hits and hashes[i] not in self._stored:
                promote = i + 1
        while len(hits) > _MAX_HIT_COUNTS:
            hits.popitem(last=False)
        if promote:
            table = self._cache.block_table(request.request_id)
            self._write_to_storage(hashes, 0, promote, self._device_fetch(table))

    # ---------------------------------------------------------------- upkeep

    def metrics(self) -> dict[str, int]:
        """Counters and gauges for the worker's ``/metrics`` (names without prefix)."""
        values = {name: getattr(self.stats, name) for name in TierStats.__slots__}
        values["host_blocks"] = len(self.host.index) if self.host else 0
        values["host_capacity_blocks"] = self.host.capacity if self.host else 0
        if self._writer is not None:
            values["storage_written_blocks"] = self._writer.written_blocks
            values["storage_dropped_blocks"] = self._writer.dropped_blocks
            values["storage_failed_blocks"] = self._writer.failed_blocks
        for kind, count in self.faults.snapshot().items():
            values[f"{FAULT_PREFIX}{kind}"] = count
        return values

    def snapshot(self) -> dict[str, list[tuple[int, int | None]]]:
        """The blocks of the tiers below the device, ``tier -> [(hash, parent_hash)]``,
        consistent with the event log's ``last_seq`` when taken on the engine thread
        (every tier event is emitted there). Storage is what this worker's events
        announced: a shared store cannot be listed per worker, and the router's index
        holds exactly that from the events anyway."""
        tiers: dict[str, list[tuple[int, int | None]]] = {}
        if self.host is not None:
            tiers["host"] = self.host.index.snapshot()
        if self._writer is not None:
            tiers["storage"] = list(self._announced.items())
        return tiers

    def check(self) -> None:
        """The device ledger's invariants (blocks loaded for a request included) and the
        host index's."""
        self._cache.check()
        if self.host is not None:
            self.host.index.check()

    def close(self) -> None:
        """Finish queued writes (for a few seconds at most) and stop the threads."""
        for thread in (self._writer, self._loader):
            if thread is not None:
                thread.close()
        if self._storage is not None:
            self._storage.close()
