"""A policy that announces its choices to peer replicas: the router's and the
simulator's replicas wrap their policy in it, so that the caller's code (the proxy's
select, undo) stays as it is for one router.

A choice is announced with what the policy records of it (``Policy.peer_choice_input``):
kv_aware's with the prompt's block hashes, cache_aware's with the prompt's text, so that
a peer's policy records it as its own (``Policy.observe_peer_choice``). The other
policies record nothing of a choice and announce none; nor does the prefill/decode pair
choice (not built). Guards' load is announced whatever the policy (by whoever owns the
guards, through :meth:`~kvserve.core.routing.announcements.Announcer.load`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.announcements import Announcer, ChoiceNote
from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.types import (
    PairDecision,
    RouteQuery,
    RoutingDecision,
    TakeBack,
    WorkerLoad,
)


class AnnouncingPolicy(Policy):
    """``inner``'s decisions, each choice told to ``announcer`` and so is its undo."""

    name = "announcing"

    def __init__(self, inner: Policy, announcer: Announcer) -> None:
        self.inner = inner
        self.announcer = announcer

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        decision = self.inner.select(query, workers, now)
        blocks = query.blocks
        kind = self.inner.peer_choice_input
        if kind == "blocks" and blocks is not None:
            cached = round(decision.matched_fraction * blocks.num_tokens)
            seq = self.announcer.choice(
                decision.worker_id, blocks.reusable_hashes, blocks.num_tokens, cached
            )
        elif kind == "text":
            seq = self.announcer.choice(
                decision.worker_id, (), query.prefill_tokens, 0, query.text, query.model, query.pool
            )
        else:
            return decision
        inner_take_back = decision.take_back

        def take_back(at: float) -> None:
            if inner_take_back is not None:
                inner_take_back(at)
            self.announcer.undo(seq)

        return dataclasses.replace(decision, take_back=take_back)

    def select_pair(
        self,
        query: RouteQuery,
        decodes: Sequence[WorkerLoad],
        prefills: Sequence[WorkerLoad],
        now: float,
        pd: PDConfig,
    ) -> PairDecision:
        return self.inner.select_pair(query, decodes, prefills, now, pd)

    def observe_events(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        self.inner.observe_events(worker_id, events)

    def observe_snapshot(self, worker_id: str, tier: str, block_hashes: Iterable[int]) -> None:
        self.inner.observe_snapshot(worker_id, tier, block_hashes)

    def observe_load(self, load: WorkerLoad) -> None:
        self.inner.observe_load(load)

    def observe_peer_choice(self, choice: ChoiceNote, now: float) -> TakeBack | None:
        return self.inner.observe_peer_choice(choice, now)

    def forget_worker(self, worker_id: str) -> None:
        self.inner.forget_worker(worker_id)
