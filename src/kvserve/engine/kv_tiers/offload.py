"""What leaves the device for the tiers, and when.

- **After a step**: blocks the step completed go to the host tier (write-through) and,
  by the write policy, to storage (``write_through``, or ``hit_count:K`` once a block
  was found in device or host memory by K admissions).
- **On preemption** (before the scheduler frees the victim's blocks): what the request
  computed is copied out for storage, so that on resume it loads instead of
  recomputing; how much of it the resume reused, loaded or recomputed is counted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.host_kv_pool import HostKVPool
from kvserve.engine.kv_block_io import KVBlockLayout, read_blocks
from kvserve.engine.kv_pool import KVPool
from kvserve.engine.kv_tiers.admission import TierAdmissions
from kvserve.engine.kv_tiers.storage_writes import Fetch, StorageWrites
from kvserve.engine.kv_tiers.tier_stats import TierStats

_MAX_HIT_COUNTS = 1 << 16  # hashes whose hits are counted for hit_count:K (LRU)


@dataclass(slots=True)
class _Progress:
    """A running request's blocks already offered to the tiers."""

    request: Request
    offered_blocks: int = 0


class TierOffload:
    def __init__(
        self,
        cache: KVCacheManager,
        pool: KVPool,
        layout: KVBlockLayout,
        host: HostKVPool | None,
        writes: StorageWrites | None,
        min_hits: int,  # hit_count:K's K; 0: write_through
        admissions: TierAdmissions,
        stats: TierStats,
    ) -> None:
        self._cache = cache
        self._block_size = cache.block_size
        self._pool = pool
        self._layout = layout
        self._host = host
        self._writes = writes
        self._min_hits = min_hits
        self._admissions = admissions
        self._stats = stats
        self._progress: dict[str, _Progress] = {}
        self._resuming: dict[str, int] = {}  # preempted request -> tokens it had computed
        self._hits: OrderedDict[int, int] = OrderedDict()

    def before_preempt(self, victim: Request) -> None:
        """Copy what ``victim`` computed out for the storage tier while its blocks still
        hold it, so that its resume loads instead of recomputing."""
        self._resuming[victim.request_id] = victim.num_computed_tokens
        if self._writes is not None:
            hashes = victim.computed_block_hashes()
            table = self._cache.block_table(victim.request_id)
            self._writes.write(hashes, 0, len(hashes), self._device_fetch(table))

    def after_step(self, plan: SchedulerOutput) -> None:
        """Offer the blocks this step completed to the host and storage tiers."""
        for chunk in plan.chunks:
            request = chunk.request
            request_id = request.request_id
            progress = self._progress.get(request_id)
            prior = self._resuming.pop(request_id, None)
            if progress is None or prior is not None:  # its first chunk since admission
                if progress is None:
                    progress = self._progress[request_id] = _Progress(request)
                if self._min_hits and self._writes is not None:
                    self._count_hits(request, chunk.start // self._block_size)
            if prior is not None:
                self._stats.resumed_loaded_tokens += self._admissions.loaded_tokens(request_id)
                reused = min(prior, chunk.start)
                self._stats.resumed_reused_tokens += reused
                self._stats.resumed_recomputed_tokens += prior - reused
            committed = request.num_committed_blocks
            if committed > progress.offered_blocks:
                self._offer(request, progress.offered_blocks, committed)
                progress.offered_blocks = committed

    def forget(self, request_id: str) -> None:
        """The request is gone."""
        self._progress.pop(request_id, None)
        self._resuming.pop(request_id, None)

    def _offer(self, request: Request, start: int, end: int) -> None:
        hashes = request.computed_block_hashes()
        table = self._cache.block_table(request.request_id)
        if self._host is not None:
            # From the first block the host lacks: a chain enters only under its parent.
            first = self._host.prefix_len(hashes[:end])
            if first < end:
                parent = hashes[first - 1] if first else None
                self._host.store(hashes[first:end], parent, self._device_fetch(table[first:end]))
        if self._writes is not None and not self._min_hits:
            self._writes.write(hashes, start, end, self._device_fetch(table))

    def _count_hits(self, request: Request, num_found: int) -> None:
        """hit_count:K: blocks found by their K-th admission are written to storage."""
        assert self._writes is not None
        hits = self._hits
        hashes = request.computed_block_hashes()
        promote = 0
        for i in range(num_found):
            count = hits.pop(hashes[i], 0) + 1
            hits[hashes[i]] = count
            if count >= self._min_hits and not self._writes.holds(hashes[i]):
                promote = i + 1
        while len(hits) > _MAX_HIT_COUNTS:
            hits.popitem(last=False)
        if promote:
            table = self._cache.block_table(request.request_id)
            self._writes.write(hashes, 0, promote, self._device_fetch(table))

    def _device_fetch(self, blocks: Sequence[int]) -> Fetch:
        return lambda i, j: read_blocks(self._pool, self._layout, blocks[i:j])
