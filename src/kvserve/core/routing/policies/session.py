"""Sticky sessions by consistent hashing of a client key (a header or the ``user`` field).

A conversation keeps landing on the worker that holds its history. Requests without a
key go to the least-loaded worker. The simulator keys a request by its trace's session
field when the trace has one (Mooncake and Azure traces have none: all go by load).

Pair rule: the default (:meth:`~kvserve.core.routing.policy.Policy.select_pair`): the
session's decode worker on the ring of decode workers with KV room, then its prefill
worker on the prefill pool's ring (one ring per pool, so neither is rebuilt per request).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.routing.hash_ring import HashRing
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.tie_breaking import PoolRotations, least_loaded
from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad


class SessionPolicy(Policy):
    name = "session"

    def __init__(self, virtual_nodes: int) -> None:
        self._virtual_nodes = virtual_nodes
        self._rings = {"regular": HashRing(virtual_nodes)}  # checks virtual_nodes now
        self._rotations = PoolRotations()

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        if query.session_key is None:
            chosen = least_loaded(workers, self._rotations[query.pool]).worker_id
            return RoutingDecision(chosen, self.name, "no_session_key")
        ring = self._rings.get(query.pool)
        if ring is None:
            ring = self._rings[query.pool] = HashRing(self._virtual_nodes)
        owner = ring.lookup(query.session_key, [w.worker_id for w in workers])
        return RoutingDecision(owner, self.name, "session")
