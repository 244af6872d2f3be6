"""Sticky sessions by consistent hashing of a client key (a header or the ``user`` field).

A conversation keeps landing on the worker that holds its history. Requests without a
key go to the least-loaded worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.routing.hash_ring import HashRing
from kvserve.core.routing.tie_breaking import Rotation, least_loaded
from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad
from kvserve.router.policies.base import Policy


class SessionPolicy(Policy):
    name = "session"

    def __init__(self, virtual_nodes: int) -> None:
        self._ring = HashRing(virtual_nodes)
        self._rotation = Rotation()

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        if query.session_key is None:
            chosen = least_loaded(workers, self._rotation).worker_id
            return RoutingDecision(chosen, self.name, "no_session_key")
        owner = self._ring.lookup(query.session_key, [w.worker_id for w in workers])
        return RoutingDecision(owner, self.name, "session")
