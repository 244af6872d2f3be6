"""The one interface every routing policy implements, driven alike by the router, its PD
proxy and the simulator.

A policy is pure: no I/O, the time is passed in. The router feeds it what it sees (loads
from its guards, the prompt hashed by its preparation step, the workers' KV events read
by its subscriber); the simulator feeds the same calls from a trace and its simulated
workers, so one object makes the same decisions in both for the same inputs.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.announcements import ChoiceNote
from kvserve.core.routing.pd_pair import (
    DECODE_POOL,
    PREFILL_POOL,
    PDConfig,
    local_prefill_reason,
    with_room,
)
from kvserve.core.routing.types import (
    PairDecision,
    RouteQuery,
    RoutingDecision,
    TakeBack,
    WorkerLoad,
    all_of,
)


class Policy(ABC):
    """Selects a worker for a request (``select``) or a prefill/decode pair (``select_pair``).

    ``workers`` (and ``decodes``) are non-empty and hold only workers that may take
    traffic now; ``prefills`` may be empty.
    """

    name: ClassVar[str]
    # Whether ``select`` reads ``RouteQuery.blocks`` (the router then hashes each prompt)
    # and the workers' KV events (the router then follows every worker's stream).
    reads_prompt_blocks: ClassVar[bool] = False
    observes_kv_events: ClassVar[bool] = False
    # What ``observe_peer_choice`` needs of another router replica's choice: the prompt's
    # "blocks" (kv_aware), its "text" (cache_aware), or nothing (None: it records none).
    peer_choice_input: ClassVar[str | None] = None

    @abstractmethod
    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision: ...

    def select_pair(
        self,
        query: RouteQuery,
        decodes: Sequence[WorkerLoad],
        prefills: Sequence[WorkerLoad],
        now: float,
        pd: PDConfig,
    ) -> PairDecision:
        """The default pair rule: this policy's own ``select`` on the decode workers with
        KV room (all of them if none has); the decode worker prefills locally when
        :func:`~kvserve.core.routing.pd_pair.prefill_remotely` says the prompt is short
        or mostly cached there (by the decode decision's matched fraction); else this
        policy's ``select`` on the prefill pool picks the prefill worker."""
        decode = self.select(dataclasses.replace(query, pool=DECODE_POOL), with_room(decodes), now)
        cached = round(decode.matched_fraction * query.prefill_tokens)
        local = local_prefill_reason(query.prefill_tokens, cached, bool(prefills), pd)
        if local is not None:
            matched = decode.matched_fraction
            return PairDecision(decode.worker_id, self.name, local, matched, decode.take_back)
        prefill = self.select(dataclasses.replace(query, pool=PREFILL_POOL), prefills, now)
        return PairDecision(
            decode.worker_id,
            self.name,
            "remote",
            prefill.matched_fraction,
            all_of((decode.take_back, prefill.take_back)),
            prefill_worker_id=prefill.worker_id,
        )

    def observe_events(self, worker_id: str, events: Sequence[KVEvent]) -> None:  # noqa: B027
        """Events of ``worker_id``'s KV stream, in order, none skipped (most policies
        read none)."""

    def observe_snapshot(  # noqa: B027
        self, worker_id: str, tier: str, block_hashes: Iterable[int]
    ) -> None:
        """What ``worker_id`` holds in ``tier`` now, replacing what its events said."""

    def observe_store(self, worker_id: str, store_id: str | None) -> None:  # noqa: B027
        """``worker_id`` loads from the KV store named ``store_id`` (None: none that
        other workers write), as its snapshot says: a block any worker of that store
        announced in its storage tier is loadable by all of them (most read no events)."""

    def observe_load(self, load: WorkerLoad) -> None:  # noqa: B027 - most read loads in select
        """The router's guards on ``load.worker_id`` now hold ``load``: called on every
        change, so that a policy can keep workers ordered by load instead of scanning
        ``select``'s loads (kv_aware)."""

    def undo(self, decision: RoutingDecision, now: float) -> None:
        """The attempt sent by ``decision`` ended before its first token (it failed, was
        refused, or is retried elsewhere): take back what the choice recorded, so that
        the worker is not predicted to hold its blocks or to compute its prompt."""
        if decision.take_back is not None:
            decision.take_back(now)

    def observe_peer_choice(
        self, choice: ChoiceNote, now: float
    ) -> TakeBack | None:  # most record nothing of a choice
        """Another router replica sent a request to ``choice.worker_id`` (see
        :mod:`kvserve.core.routing.announcements`): record it as this policy records its
        own choices, so that its next decisions see that work; returns what takes the
        record back (the peer's attempt ended before its first token)."""
        return None

    def as_replica(self, replica: str, rank: int) -> None:  # noqa: B027 - most rank alike anyway
        """This policy is the router replica named ``replica``, one of several that
        route the same fleet, ranked ``rank`` (0, 1, ...: a different one per replica)
        among them: kv_aware then defers its decisions in bursts by rank (see
        :meth:`decision_delay`) and may salt its near-ties by replica (see
        :class:`~kvserve.core.routing.tie_breaking.ReplicaSalt`). Not called for a lone
        router."""

    def decision_delay(self, now: float) -> float:
        """Seconds the router waits, from a request's arrival at ``now``, before calling
        :meth:`select` (or :meth:`select_pair`) for it; nothing is held meanwhile. 0 but
        for a kv_aware replica of several in a burst (its peers' choices announced first)."""
        return 0.0

    def forget_worker(self, worker_id: str) -> None:  # noqa: B027 - most keep no state
        """Drop what the policy learned about a worker that left the fleet."""
