"""The routing policies the simulator compares, over the router's own pure logic.

Each one wraps the decision code the router runs (:mod:`kvserve.core.routing`) and sees
what the router would: the loads its own guards hold (in-flight requests and prompt
tokens until the first token) and, for ``kv_aware``, the workers' KV events. Only the
prompt's form differs: ``cache_aware`` matches characters, so each trace block becomes
one character (distinct blocks, distinct characters), which keeps its matched fraction a
fraction of blocks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from kvserve.core.kv_events import KVEvent
from kvserve.core.request import Request
from kvserve.core.routing import cache_aware
from kvserve.core.routing.kv_aware import KvAwareConfig, KvAwareRouting
from kvserve.core.routing.tie_breaking import Rotation, least_loaded
from kvserve.core.routing.types import WorkerLoad

_FIRST_BLOCK_CHAR = 0x10000  # above the BMP's surrogates: every hash id is one code point


class SimPolicy(Protocol):
    name: str

    def route(
        self, request: Request, hash_ids: Sequence[int], loads: Sequence[WorkerLoad], now: float
    ) -> str: ...

    def observe(self, worker_id: str, events: Sequence[KVEvent]) -> None: ...


class _Stateless:
    def observe(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        """Routing history or nothing: these policies read no KV events."""


class RoundRobin(_Stateless):
    name = "round_robin"

    def __init__(self) -> None:
        self._rotation = Rotation()

    def route(
        self, request: Request, hash_ids: Sequence[int], loads: Sequence[WorkerLoad], now: float
    ) -> str:
        return self._rotation.pick(loads).worker_id


class RandomChoice(_Stateless):
    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def route(
        self, request: Request, hash_ids: Sequence[int], loads: Sequence[WorkerLoad], now: float
    ) -> str:
        return self._rng.choice(loads).worker_id


class LeastLoaded(_Stateless):
    """Fewest in-flight requests: with one shared cache (``global``) load is all that
    is left to decide."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._rotation = Rotation()

    def route(
        self, request: Request, hash_ids: Sequence[int], loads: Sequence[WorkerLoad], now: float
    ) -> str:
        return least_loaded(loads, self._rotation).worker_id


class CacheAware(_Stateless):
    name = "cache_aware"

    def __init__(self, config: cache_aware.CacheAwareConfig, now: float) -> None:
        self._config = config
        self._index = cache_aware.CacheAwareIndex(config, now)
        self._rotation = Rotation()

    def route(
        self, request: Request, hash_ids: Sequence[int], loads: Sequence[WorkerLoad], now: float
    ) -> str:
        text = "".join(chr(_FIRST_BLOCK_CHAR + h) for h in hash_ids)
        self._index.maybe_trim(now)
        tree = self._index.tree("regular", "")
        choice = cache_aware.choose(
            loads, tree.match(text), len(text), self._config, self._rotation
        )
        tree.insert(text, choice.worker.worker_id, now)
        return choice.worker.worker_id


class KvAware:
    name = "kv_aware"

    def __init__(self, config: KvAwareConfig, block_size: int) -> None:
        self.routing = KvAwareRouting(config)
        self._block_size = block_size

    def route(
        self, request: Request, hash_ids: Sequence[int], loads: Sequence[WorkerLoad], now: float
    ) -> str:
        choice = self.routing.route(
            loads, request.reusable_block_hashes(), request.num_prompt_tokens, self._block_size, now
        )
        return choice.worker_id

    def observe(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        for event in events:
            self.routing.index.apply(worker_id, event)
