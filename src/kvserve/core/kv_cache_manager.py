"""The scheduler's view of the KV cache: blocks per request (docs/internals.md).

The block ledger knows blocks; this façade knows requests. Each request has a block
table (its blocks in token order) and the chain of cached blocks it pins: the prefix it
matched, then each block it committed. A request whose block turns out to be cached
already (another request committed the same hash first) keeps its own copy owned, and
pins the cached one instead, so its chain of pins stays unbroken from the root: a block
it commits later always has its parent cached and pinned, and a suffix never outlives
its prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.core.block_ledger import BlockLedger, CacheStats
from kvserve.core.invariants import require
from kvserve.core.kv_cache_errors import RequestStateError
from kvserve.core.kv_events import EventLog

Snapshot = tuple[int, list[tuple[int, int | None]]]


@dataclass(slots=True)
class _RequestBlocks:
    table: list[int] = field(default_factory=list)
    # pinned[i] is the cached block holding hash i of the request's chain; it is
    # table[i] unless the request's own block i was a duplicate (then it stays owned).
    pinned: list[int] = field(default_factory=list)

    def owned_blocks(self) -> list[int]:
        pinned = self.pinned
        owned = [own for own, cached in zip(self.table, pinned, strict=False) if own != cached]
        owned.extend(self.table[len(pinned) :])
        return owned


class KVCacheManager:
    """Per-request block tables over one tier's :class:`BlockLedger`."""

    __slots__ = ("_ledger", "_requests", "block_size", "num_blocks")

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        tier: str = "device",
        events: EventLog | None = None,
    ) -> None:
        self._ledger = BlockLedger(num_blocks, block_size, tier=tier, events=events)
        self._requests: dict[str, _RequestBlocks] = {}
        self.num_blocks = num_blocks
        self.block_size = block_size

    # ---------------------------------------------------------------- counts

    @property
    def events(self) -> EventLog:
        return self._ledger.events

    @property
    def tier(self) -> str:
        return self._ledger.tier

    @property
    def stats(self) -> CacheStats:
        return self._ledger.stats

    @property
    def num_free_blocks(self) -> int:
        return self._ledger.num_free_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return self._ledger.num_evictable_blocks

    @property
    def num_available_blocks(self) -> int:
        return self._ledger.num_available_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self._ledger.num_cached_blocks

    # ---------------------------------------------------------------- requests

    def match_prefix(self, request_id: str, hashes: Sequence[int]) -> int:
        """Pin the longest cached prefix of ``hashes`` as the start of the request's table.

        Returns the number of matched blocks. A request that owns no blocks may match
        again (a scheduler retrying admission): its previous pins are released first. One
        that owns blocks must be freed before it matches again. Nothing is counted: the
        scheduler counts a request's cached tokens once, however often it matches.
        """
        previous = self._requests.get(request_id)
        if previous is not None and previous.owned_blocks():
            raise RequestStateError(
                f"request {request_id!r} owns blocks: free it before matching again"
            )
        blocks = self._ledger.match(hashes)
        if previous is not None:
            self.free_request(request_id)
        self._requests[request_id] = _RequestBlocks(table=blocks, pinned=blocks.copy())
        return len(blocks)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens; False (no change) if
        free plus evictable blocks cannot cover it."""
        request = self._requests.get(request_id)
        have = len(request.table) if request else 0
        need = -(-num_tokens // self.block_size) - have
        if need <= 0:
            return True
        ledger = self._ledger
        if need > ledger.num_available_blocks:
            return False
        if request is None:
            request = self._requests[request_id] = _RequestBlocks()
        request.table.extend(ledger.allocate(need))
        return True

    def commit_blocks(
        self, request_id: str, hashes: Sequence[int], token_ids: Sequence[int] = ()
    ) -> None:
        """Commit the request's full blocks ``hashes[i]`` (block i) not yet committed.

        ``token_ids``, the request's tokens from its first, go into the ``stored`` event
        when given and the log records tokens (a vLLM-format subscriber keys blocks by
        them)."""
        request = self._require(request_id)
        pinned = request.pinned
        done = len(pinned)
        if len(hashes) <= done:
            return
        table = request.table
        if len(hashes) > len(table):
            raise RequestStateError(
                f"request {request_id!r}: {len(hashes)} block hashes for a table of "
                f"{len(table)} blocks"
            )
        ledger = self._ledger
        parent_hash = ledger.hash_of(pinned[-1]) if done else None
        if done and parent_hash != hashes[done - 1]:
            raise RequestStateError(
                f"request {request_id!r}: hash of block {done - 1} differs from the one "
                "it matched or committed"
            )
        size = ledger.block_size
        keep = token_ids and ledger.events.record_tokens
        tokens = token_ids[done * size : len(hashes) * size] if keep else ()
        pinned.extend(ledger.insert(hashes[done:], table[done : len(hashes)], parent_hash, tokens))

    def num_request_blocks(self, request_id: str) -> int:
        """Blocks in the request's table (0 for an unknown id), without copying it."""
        request = self._requests.get(request_id)
        return len(request.table) if request else 0

    def block_table(self, request_id: str) -> list[int]:
        request = self._requests.get(request_id)
        return request.table.copy() if request else []

    def free_request(self, request_id: str) -> None:
        """Unpin the request's cached blocks and free its owned ones; unknown ids are a
        no-op (a request may end before it was ever given blocks)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        ledger = self._ledger
        ledger.unpin(request.pinned[::-1])  # deepest first: cheapest for the tree
        ledger.free(request.owned_blocks())

    def ref_count(self, block: int) -> int:
        """Requests pinning a cached block (0 for a free or owned one): a prompt's blocks
        shared by forked choices are pinned once per choice, allocated once."""
        return self._ledger.ref_count(block)

    def lookup_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes``, not pinned: valid only
        until the next allocation may evict them."""
        return self._ledger.lookup(hashes)

    # ---------------------------------------------------------------- whole cache

    def evict(self, num_blocks: int) -> int:
        return self._ledger.evict(num_blocks)

    def clear(self) -> None:
        self._ledger.clear()

    def snapshot(self) -> Snapshot:
        """``(last_seq, [(hash, parent_hash), ...])``, parents first: replaying events
        after ``last_seq`` on top of it gives the current content."""
        return self.events.last_seq, self._ledger.cached_hashes()

    def check(self) -> None:
        """Ledger invariants, plus: pins are exactly the requests' pins, owned blocks are
        exactly the requests' owned blocks, each request's pins form a chain."""
        ledger = self._ledger
        ledger.check()
        pins: Counter[int] = Counter()
        owned: list[int] = []
        for request_id, request in self._requests.items():
            pins.update(request.pinned)
            owned.extend(request.owned_blocks())
            require(len(request.pinned) <= len(request.table), f"{request_id}: pins > table")
            parent = None
            for block in request.pinned:
                require(ledger.ref_count(block) > 0, f"{request_id}: block {block} not pinned")
                block_hash = ledger.hash_of(block)
                require(ledger.parent_hash_of(block) == parent, f"{request_id}: chain broken")
                parent = block_hash
        require(dict(pins) == ledger.pinned_counts(), "ref counts differ from requests' pins")
        require(len(set(owned)) == len(owned), "an owned block belongs to two requests")
        require(all(ledger.state_of(block) == "owned" for block in owned), "owned block state")
        require(len(owned) == ledger.num_owned_blocks, "an owned block belongs to no request")

    def _require(self, request_id: str) -> _RequestBlocks:
        request = self._requests.get(request_id)
        if request is None:
            raise RequestStateError(f"request {request_id!r} holds no blocks")
        return request


__all__ = ["CacheStats", "KVCacheManager", "Snapshot"]
