"""A policy that announces its choices to peer replicas: the router's and the
simulator's replicas wrap their policy in it, so that the caller's code (the proxy's
select, undo) stays as it is for one router.

A choice is announced with what the policy records of it (``Policy.peer_choice_input``):
kv_aware's with the prompt's block hashes, cache_aware's with the prompt's text, so that
a peer's policy records it as its own (``Policy.observe_peer_choice``). The other
policies record nothing of a choice and announce none. A prefill/decode pair is
announced as the two records the policy made: the prompt on the prefill worker (its
prefill queued there) and on the decode worker (kv_aware: blocks expected, no prefill),
or on the decode worker alone when it prefills locally. Guards' load is announced by
whoever owns the guards, through
:meth:`~kvserve.core.routing.announcements.Announcer.load`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.announcements import Announcer, ChoiceNote
from kvserve.core.routing.pd_pair import DECODE_POOL, PREFILL_POOL, PDConfig
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
        seq = self._announce(query, now, decision.worker_id, decision.matched_fraction, query.pool)
        if seq is None:
            return decision
        return dataclasses.replace(decision, take_back=self._undoing(decision.take_back, seq))

    def select_pair(
        self,
        query: RouteQuery,
        decodes: Sequence[WorkerLoad],
        prefills: Sequence[WorkerLoad],
        now: float,
        pd: PDConfig,
    ) -> PairDecision:
        decision = self.inner.select_pair(query, decodes, prefills, now, pd)
        matched, decode_id = decision.matched_fraction, decision.worker_id
        prefill_id = decision.prefill_worker_id
        seqs: tuple[int, ...]
        if prefill_id is None:  # the decode worker prefills the prompt itself
            seq = self._announce(query, now, decode_id, matched, DECODE_POOL)
            seqs = () if seq is None else (seq,)
        else:
            seqs = tuple(
                seq
                for seq in (
                    self._announce(query, now, prefill_id, matched, PREFILL_POOL),
                    self._announce(query, now, decode_id, 0.0, DECODE_POOL, computes=False),
                )
                if seq is not None
            )
        if not seqs:
            return decision
        return dataclasses.replace(decision, take_back=self._undoing(decision.take_back, *seqs))

    def _announce(
        self,
        query: RouteQuery,
        now: float,
        worker_id: str,
        matched_fraction: float,
        pool: str,
        computes: bool = True,
    ) -> int | None:
        """Announce that ``worker_id`` got the prompt, in the form the inner policy
        records it; its number, or None where the policy records nothing of it."""
        blocks = query.blocks
        kind = self.inner.peer_choice_input
        if kind == "blocks" and blocks is not None:
            cached = round(matched_fraction * blocks.num_tokens)
            return self.announcer.choice(
                worker_id,
                blocks.reusable_hashes,
                blocks.num_tokens,
                cached,
                pool=pool,
                computes=computes,
                at=now,
            )
        if kind == "text":
            return self.announcer.choice(
                worker_id,
                (),
                query.prefill_tokens,
                0,
                query.text,
                query.model,
                pool,
                computes,
                at=now,
            )
        return None

    def _undoing(self, inner_take_back: TakeBack | None, *seqs: int) -> TakeBack:
        """``inner_take_back``, then the undo of the announced choices ``seqs``."""

        def take_back(at: float) -> None:
            if inner_take_back is not None:
                inner_take_back(at)
            for seq in seqs:
                self.announcer.undo(seq)

        return take_back

    def observe_events(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        self.inner.observe_events(worker_id, events)

    def observe_snapshot(self, worker_id: str, tier: str, block_hashes: Iterable[int]) -> None:
        self.inner.observe_snapshot(worker_id, tier, block_hashes)

    def observe_store(self, worker_id: str, store_id: str | None) -> None:
        self.inner.observe_store(worker_id, store_id)

    def observe_load(self, load: WorkerLoad) -> None:
        self.inner.observe_load(load)

    def observe_peer_choice(self, choice: ChoiceNote, now: float) -> TakeBack | None:
        return self.inner.observe_peer_choice(choice, now)

    def as_replica(self, replica: str, rank: int) -> None:
        self.inner.as_replica(replica, rank)

    def decision_delay(self, now: float) -> float:
        return self.inner.decision_delay(now)

    def forget_worker(self, worker_id: str) -> None:
        self.inner.forget_worker(worker_id)
