"""A uniformly random worker: stateless, and the floor for cache hit rate.

Pair rule: the default (:meth:`~kvserve.core.routing.policy.Policy.select_pair`): a
random decode worker with KV room, then a random prefill worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvserve.core.routing.policy import Policy
from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        return RoutingDecision(self._rng.choice(workers).worker_id, self.name, "random")
