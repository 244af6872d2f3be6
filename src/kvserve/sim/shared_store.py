"""A KV store the whole simulated fleet shares, as workers started with one ``--kv-storage``.

Every block a worker commits is written through to it (LRU, bounded in blocks), and the
writer announces the write in tier ``storage`` with the store's eviction as ``removed``,
as a real worker's storage events do; every worker is told it loads from that store
(``Policy.observe_store``), so kv_aware credits a block to all of them. A request whose
prompt the store continues past the device's prefix waits for its load, beside the
worker's steps, and its blocks are installed before it is admitted (:class:`StoreLoads`,
the scheduler's connector, as the engine's tiers load and install).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus

STORE_ID = "sim-store"  # the name every simulated worker reports for the store


class SimStore:
    """Block hashes, least recently written or read first, at most ``capacity_blocks``."""

    def __init__(self, capacity_blocks: int, load_token_s: float) -> None:
        if capacity_blocks < 1:
            raise ValueError("a shared store holds at least one block")
        if load_token_s < 0:
            raise ValueError("load_token_s must be >= 0")
        self.capacity_blocks = capacity_blocks
        self.load_token_s = load_token_s
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.loaded_tokens = 0  # installed from the store, over the whole run

    def write(self, block_hashes: Sequence[int]) -> list[int]:
        """Store the blocks (written again: now the newest); returns those evicted."""
        blocks = self._blocks
        for block_hash in block_hashes:
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        evicted: list[int] = []
        while len(blocks) > self.capacity_blocks:
            evicted.append(blocks.popitem(last=False)[0])
        return evicted

    def run(self, block_hashes: Sequence[int], start: int) -> int:
        """How many blocks from ``start`` the store holds in a row (each read: the newest)."""
        blocks = self._blocks
        count = 0
        for block_hash in block_hashes[start:]:
            if block_hash not in blocks:
                break
            blocks.move_to_end(block_hash)
            count += 1
        return count


class StoreLoads:
    """One worker's scheduler connector for the store, as the engine's tiers admit.

    A waiting request whose prompt continues, in the store, past the device's prefix
    waits for its load (later requests may go meanwhile): loads run one at a time per
    worker, beside the steps (the engine's loader thread), each ``loaded tokens ×
    load_token_s`` long. When its load is done the store's run is installed in the
    device cache, pinned under a holder of its own until the request is admitted (its
    own match then pins it). A loaded request whose install finds no room keeps what it
    loaded and tries again at each admission, keeping its place in the queue (a new
    load would let later requests overtake it, over and over). The worker sets
    :attr:`now` before each schedule.
    """

    def __init__(self, store: SimStore, kv_cache: KVCacheManager) -> None:
        self._store = store
        self._cache = kv_cache
        self.now = 0.0
        self._free_at = 0.0  # when the worker's loads in flight are done
        self._ready: dict[str, float] = {}  # request id -> when its load is done
        self._loaded: set[str] = set()  # loaded, not installed yet (no room so far)
        self._holders: dict[str, Request] = {}  # holder id -> the waiting request

    def may_admit(self, request: Request) -> bool:
        request_id = request.request_id
        ready_at = self._ready.get(request_id)
        if ready_at is not None:
            if self.now < ready_at:
                return False
            del self._ready[request_id]
            self._loaded.add(request_id)
        if request_id in self._loaded:
            if self._install(request):
                self._loaded.discard(request_id)
            return True
        cache, hashes = self._cache, request.reusable_block_hashes()
        loaded = self._store.run(hashes, len(cache.lookup_prefix(hashes)))
        if not loaded:
            return True
        start = max(self.now, self._free_at)
        self._free_at = start + loaded * cache.block_size * self._store.load_token_s
        self._ready[request.request_id] = self._free_at
        return False

    def next_ready(self) -> float | None:
        """When the next load in flight is done (None: none is)."""
        return min(self._ready.values(), default=None)

    def _install(self, request: Request) -> bool:
        """The store's run after the device's prefix, as it is now, into the device;
        False where there is no room for it yet."""
        cache, hashes = self._cache, request.reusable_block_hashes()
        holder = _holder(request)
        if holder in self._holders:  # installed, not admitted, and the store has more since
            cache.free_request(holder)
            del self._holders[holder]
        on_device = len(cache.lookup_prefix(hashes))
        total = on_device + self._store.run(hashes, on_device)
        if total == on_device:
            return True
        cache.match_prefix(holder, hashes[:on_device])
        if not cache.allocate_slots(holder, total * cache.block_size):
            cache.free_request(holder)
            return False
        cache.commit_blocks(holder, hashes[:total])
        self._holders[holder] = request
        self._store.loaded_tokens += (total - on_device) * cache.block_size
        return True

    def release_admitted(self) -> None:
        """Unpin the installs of requests no longer waiting (admitted, or gone)."""
        for holder, request in list(self._holders.items()):
            if request.status is not RequestStatus.WAITING:
                self._cache.free_request(holder)
                del self._holders[holder]

    def request_added(self, request: Request) -> None:
        pass

    def before_preempt(self, request: Request) -> None:
        pass

    def request_finished(self, request: Request) -> None:
        self._ready.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        holder = _holder(request)
        if self._holders.pop(holder, None) is not None:
            self._cache.free_request(holder)


def _holder(request: Request) -> str:
    return f"store-load:{request.request_id}"
