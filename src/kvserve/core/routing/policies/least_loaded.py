"""The worker with the fewest in-flight requests (then the least queued prefill work).

Blind to caches: with one shared cache (the simulator's ``global`` ceiling) load is all
that is left to decide, and elsewhere it shows what cache awareness adds. Ties rotate.

Pair rule: the default (:meth:`~kvserve.core.routing.policy.Policy.select_pair`): the
least-loaded decode worker with KV room, then the least-loaded prefill worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.routing.policy import Policy
from kvserve.core.routing.tie_breaking import PoolRotations, least_loaded
from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def __init__(self) -> None:
        self._rotations = PoolRotations()

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        chosen = least_loaded(workers, self._rotations[query.pool])
        return RoutingDecision(chosen.worker_id, self.name, "least_loaded")
