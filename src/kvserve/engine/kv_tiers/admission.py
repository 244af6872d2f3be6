"""Admission from the tiers: a waiting request starts from blocks found below the device.

Asked by the scheduler before it admits a waiting request (``may_admit``), the
request's blocks are looked up device first, then host, then storage, as a longest
prefix. Host blocks are copied at once into freshly allocated device blocks; if the
storage tier may hold more, the request is held back (later requests go ahead) while
the loader thread looks and reads, and loads that finished are collected before each
step.

Installs are fenced by ownership: blocks are allocated to a holder of their own
(``tier-load:<request id>``), written while still owned (no request can read them, the
allocator cannot reuse them), then committed and kept pinned until the request is
admitted. A storage value is verified (checksum, key, layout) before it is installed;
any failure is a miss, counted and logged once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.engine.host_kv_pool import HostKVPool
from kvserve.engine.kv_block_io import KVBlockLayout, write_blocks
from kvserve.engine.kv_connector import QueueView
from kvserve.engine.kv_offload import LoadJob, LoadResult, StorageLoader
from kvserve.engine.kv_pool import KVPool
from kvserve.engine.kv_tiers.tier_stats import TierStats

# While the only waiting work is loads, the engine thread waits this long for one to
# finish instead of spinning through empty steps.
_IDLE_WAIT_S = 0.02

InstallOutcome = Literal["installed", "nothing", "no_room", "gap"]


@dataclass(slots=True)
class _Admission:
    """A waiting request the tiers looked at: loading, or loaded and pinned for it."""

    request: Request
    loading: bool = False  # the loader thread is looking it up in storage
    loaded: LoadResult | None = None  # storage blocks read, not installed yet
    installed: bool = False  # found blocks are in the device cache, pinned for it
    loaded_tokens: int = 0


def _holder(request_id: str) -> str:
    """The KV cache holder of blocks loaded for a request, beside the request itself."""
    return f"tier-load:{request_id}"


class TierAdmissions:
    def __init__(
        self,
        cache: KVCacheManager,
        pool: KVPool,
        layout: KVBlockLayout,
        host: HostKVPool | None,
        loader: StorageLoader | None,
        stats: TierStats,
    ) -> None:
        self._cache = cache
        self._block_size = cache.block_size
        self._pool = pool
        self._layout = layout
        self._host = host
        self._loader = loader
        self._stats = stats
        self._admissions: dict[str, _Admission] = {}

    def may_admit(self, request: Request) -> bool:
        """False while the request's blocks load.

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

    def loaded_tokens(self, request_id: str) -> int:
        """Tokens installed from the tiers for a request not yet released."""
        admission = self._admissions.get(request_id)
        return 0 if admission is None else admission.loaded_tokens

    def collect(self, queues: QueueView) -> None:
        """Take the finished loads; let admitted requests' installs go (they pin them)."""
        if self._loader is not None:
            for result in self._loader.results(self._idle_wait_s(queues)):
                self._finish_load(result)
        for request_id, admission in list(self._admissions.items()):
            if not admission.loading and admission.request.status is not RequestStatus.WAITING:
                self._release(request_id)

    def forget(self, request_id: str) -> None:
        """The request is gone: unpin what was installed for it, ignore its load."""
        if request_id in self._admissions:
            self._release(request_id)

    def _load(self, admission: _Admission, hashes: list[int], start: int) -> None:
        admission.loading = True
        admission.loaded = None
        self._stats.storage_lookups += 1
        assert self._loader is not None
        self._loader.submit(LoadJob(admission.request.request_id, start, tuple(hashes[start:])))

    def _look_up(self, hashes: list[int]) -> tuple[int, int]:
        """How many leading blocks the device holds, and device and host together."""
        in_device = len(self._cache.lookup_prefix(hashes))
        host = self._host
        return in_device, in_device + (host.prefix_len(hashes, in_device) if host else 0)

    def _install(self, admission: _Admission, hashes: list[int]) -> InstallOutcome:
        """Copy the request's blocks found in host memory (and those loaded from storage)
        into new device blocks, commit them, pin them until admission."""
        cache, host = self._cache, self._host
        in_device = len(cache.lookup_prefix(hashes))
        from_host = host.prefix_len(hashes, in_device) if host else 0
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
            assert host is not None
            write_blocks(
                self._pool, self._layout, table[in_device:end], host.read(hashes[in_device:end])
            )
        if stored is not None and from_storage:
            write_blocks(self._pool, self._layout, table[end:total], stored)
            if host is not None:  # loaded once, kept close for the next request
                host.store(hashes[end:total], hashes[end - 1] if end else None,
                           lambda i, j: stored[i:j])  # fmt: skip
        cache.commit_blocks(holder, hashes[:total], admission.request.token_ids)
        self._stats.host_hit_tokens += from_host * self._block_size
        self._stats.storage_hit_tokens += from_storage * self._block_size
        admission.loaded_tokens = (total - in_device) * self._block_size
        admission.loaded = None
        return "installed"

    def _idle_wait_s(self, queues: QueueView) -> float:
        """Wait for a load only when nothing else could run meanwhile."""
        if queues.running or not queues.waiting:
            return 0.0
        for request in queues.waiting:
            admission = self._admissions.get(request.request_id)
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
            self._stats.loads_without_room += 1
