"""The lighter of two random workers: near-least-loaded balance at O(1) cost.

Pair rule: the default (:meth:`~kvserve.core.routing.policy.Policy.select_pair`): the
lighter of two decode workers with KV room, then the lighter of two prefill workers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvserve.core.routing.policy import Policy
from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        if len(workers) == 1:
            return RoutingDecision(workers[0].worker_id, self.name, "only_worker")
        first, second = self._rng.sample(list(workers), 2)
        chosen = first if first.sort_key <= second.sort_key else second
        return RoutingDecision(chosen.worker_id, self.name, "lighter_of_two")
