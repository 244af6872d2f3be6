"""Each available worker in turn: the baseline every other policy is measured against."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad
from kvserve.router.policies.base import Policy


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        chosen = workers[self._turn % len(workers)]
        self._turn += 1
        return RoutingDecision(chosen.worker_id, self.name, "rotation")
