"""Cache-aware routing over an approximate prefix tree learned from routing history.

See :mod:`kvserve.core.routing.cache_aware` for the rule and how it departs from the
established gateways (ties by load, rotation on a miss, one budget, one tree per pool
and model).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.routing.cache_aware import CacheAwareConfig, CacheAwareIndex, choose
from kvserve.core.routing.tie_breaking import Rotation
from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad
from kvserve.router.policies.base import Policy


class CacheAwarePolicy(Policy):
    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig, now: float) -> None:
        self._config = config
        self._index = CacheAwareIndex(config, now)
        self._rotation = Rotation()

    @property
    def index_size_chars(self) -> int:
        return self._index.size_chars

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        self._index.maybe_trim(now)
        tree = self._index.tree(query.pool, query.model)
        choice = choose(
            workers, tree.match(query.text), len(query.text), self._config, self._rotation
        )
        tree.insert(query.text, choice.worker.worker_id, now)
        return RoutingDecision(
            choice.worker.worker_id, self.name, choice.reason, choice.matched_fraction
        )

    def forget_worker(self, worker_id: str) -> None:
        self._index.forget_worker(worker_id)
