"""Router replicas in the simulator: each routes its share of requests with its own
policy object and its own guards, all fed the same KV events.

A large fleet runs several router replicas behind one address. Each sees its own
in-flight load exactly (its guards) and nothing of the others': R replicas each believe a
worker is idle while together they queue R requests on it. What a replica can learn of
the others' load is what workers report. The model: every ``load_report_interval_s``
each worker reports what is in flight on it (all replicas' guards, exactly as they
stand), and a replica's view of a worker is its own guards now plus the others' part of
the last report (the report less what the replica itself held then): their requests
added to its own, their prefill tokens apart (``WorkerLoad.others_prefill_tokens``),
since kv_aware weighs its own prefill queue against its own guards and must add the
others' queue, not hide it behind a minimum. Without reports (``None``) a replica sees
its own guards only, the fragmentation to measure; with 0, every worker reports before
each decision.

With announcements (``announce``), each replica tells the others every choice and every
change of its guards (:mod:`kvserve.core.routing.announcements`), which the simulator
delivers after a modelled network delay: a replica's view of a worker is then its own
guards plus the others' as last announced, and its policy records their choices as its
own (kv_aware: their prefill queued, their blocks speculated).

With several replicas, each policy is told its replica's name (``Policy.as_replica``):
kv_aware then salts its near-equal choices by replica, so that a burst arriving at one
instant does not go from every replica to the same worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.routing.announcements import Announcement, Announcer, PeerView
from kvserve.core.routing.announcing_policy import AnnouncingPolicy
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.pool_loads import PoolLoads
from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad


class RouterReplica:
    """One replica's policy and load view, told to its policy on every change as the
    router's :class:`~kvserve.router.load_guard.LoadTracker` does."""

    def __init__(
        self,
        policy: Policy,
        worker_ids: Sequence[str],
        name: str = "router",
        announce: bool = False,
        one_of_several: bool = False,
        rank: int = 0,
    ) -> None:
        self.policy = policy
        if one_of_several:  # the real router's replicas do the same (router/app.py)
            policy.as_replica(name, rank)
        self.announcer = Announcer(name)
        self._announcing = AnnouncingPolicy(policy, self.announcer) if announce else None
        self.peers = PeerView(policy.observe_peer_choice, self._peer_load_changed)
        self.requests = dict.fromkeys(worker_ids, 0)  # own guards
        self.prefill_tokens = dict.fromkeys(worker_ids, 0)
        self._others = {w: (0, 0) for w in worker_ids}  # the others' part of the last report
        # the view kept between decisions, as the router keeps its pools' loads
        self._pool = PoolLoads(self._view(w) for w in worker_ids)

    def select(self, query: RouteQuery, now: float) -> RoutingDecision:
        """The policy's choice on this replica's view (announced, with announcements)."""
        routing = self.policy if self._announcing is None else self._announcing
        return routing.select(query, self.snapshot(), now)

    def adjust(self, worker_id: str, requests: int, prefill_tokens: int) -> None:
        self.requests[worker_id] += requests
        self.prefill_tokens[worker_id] += prefill_tokens
        if self._announcing is not None:
            self.announcer.load(worker_id, self.requests[worker_id], self.prefill_tokens[worker_id])
        self._load_changed(worker_id)

    def announcement(self) -> Announcement | None:
        """What this replica has to announce since the last call (None: nothing)."""
        if self._announcing is None:
            return None
        taken = self.announcer.take()
        return None if taken.is_empty() else taken

    def deliver(self, announcement: Announcement, now: float) -> None:
        """Another replica's announcement arrives."""
        self.peers.apply(announcement, now)

    def learn_report(self, worker_id: str, requests: int, prefill_tokens: int) -> None:
        """``worker_id`` reports ``requests`` and ``prefill_tokens`` in flight, of all
        replicas."""
        peer_requests, peer_tokens = self.peers.load(worker_id)
        others = (  # what announcements have not told (yet), if any
            max(0, requests - self.requests[worker_id] - peer_requests),
            max(0, prefill_tokens - self.prefill_tokens[worker_id] - peer_tokens),
        )
        if others != self._others[worker_id]:
            self._others[worker_id] = others
            self._load_changed(worker_id)

    def snapshot(self) -> PoolLoads:
        """Every worker's load as this replica sees it (kept: valid until it changes)."""
        return self._pool

    def _peer_load_changed(self, worker_id: str) -> None:
        self._load_changed(worker_id)

    def _load_changed(self, worker_id: str) -> None:
        """The view of ``worker_id`` changed: kept, and told to the policy."""
        load = self._view(worker_id)
        self._pool.replace(load)
        self.policy.observe_load(load)

    def _view(self, worker_id: str) -> WorkerLoad:
        other_requests, other_tokens = self._others[worker_id]
        peer_requests, peer_tokens = self.peers.load(worker_id)
        return WorkerLoad(
            worker_id,
            self.requests[worker_id] + peer_requests + other_requests,
            self.prefill_tokens[worker_id] + peer_tokens,
            others_prefill_tokens=other_tokens,
        )
