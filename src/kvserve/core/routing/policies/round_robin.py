"""Each available worker in turn: the baseline every other policy is measured against.

Pair rule: the default (:meth:`~kvserve.core.routing.policy.Policy.select_pair`), each
pool with its own turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.routing.policy import Policy
from kvserve.core.routing.tie_breaking import PoolRotations
from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._rotations = PoolRotations()

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        chosen = self._rotations[query.pool].pick(workers)
        return RoutingDecision(chosen.worker_id, self.name, "rotation")
