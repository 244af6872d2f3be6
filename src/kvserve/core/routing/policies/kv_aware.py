"""Exact KV-aware routing, from the prompt's block hashes and the workers' KV events.

The rule and the index are :mod:`kvserve.core.routing.kv_aware`'s. The prompt's blocks
come in ``RouteQuery.blocks``: the router hashes each request with the model's tokenizer
(:mod:`kvserve.router.prompt_preparer`), the simulator takes them from its trace. The
events come through ``observe_events`` / ``observe_snapshot``: the router's
:class:`~kvserve.router.kv_event_subscriber.KVEventSubscriber` follows every worker of
every pool, the simulator hands over what each simulated cache emitted. Without blocks
(no tokenizer, no block size yet, a body the worker would refuse) requests go to the
least-loaded worker and say so (``reason=no_tokenizer``).

Pair rule, both pools predicted exactly from their own workers' events: the decode
worker with KV room whose predicted TTFT, were it to prefill the prompt itself, is the
smallest; it prefills locally when :func:`~kvserve.core.routing.pd_pair.prefill_remotely`
says its exact cached tokens make a prefill worker not worth it; else the prefill worker
with the smallest predicted TTFT computes the prompt. The prefill work is queued on the
worker that computes it, and the prompt's blocks are expected on both (the decode
worker installs what the prefill worker sends).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.announcements import ChoiceNote
from kvserve.core.routing.kv_aware import (
    KvAwareChoice,
    KvAwareConfig,
    KvAwareRouting,
    Prediction,
)
from kvserve.core.routing.pd_pair import PDConfig, local_prefill_reason, with_room
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.tie_breaking import PoolRotations, least_loaded
from kvserve.core.routing.types import (
    PairDecision,
    RouteQuery,
    RoutingDecision,
    TakeBack,
    WorkerLoad,
    all_of,
)


class KvAwarePolicy(Policy):
    name = "kv_aware"
    reads_prompt_blocks = True
    observes_kv_events = True
    peer_choice_input = "blocks"

    def __init__(self, config: KvAwareConfig) -> None:
        self.routing = KvAwareRouting(config)
        self._rotations = PoolRotations()

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        blocks = query.blocks
        if blocks is None:
            chosen = least_loaded(workers, self._rotations[query.pool])
            return RoutingDecision(chosen.worker_id, self.name, "no_tokenizer")
        hashes, tokens = blocks.reusable_hashes, blocks.num_tokens
        self.routing.arrived(now)
        choice = self.routing.best(workers, hashes, tokens, blocks.block_size, now)
        take_back = self.routing.expect_prefill(choice, hashes, tokens, now)
        matched = _matched(choice, tokens)
        return RoutingDecision(choice.worker_id, self.name, choice.reason, matched, take_back)

    def select_pair(
        self,
        query: RouteQuery,
        decodes: Sequence[WorkerLoad],
        prefills: Sequence[WorkerLoad],
        now: float,
        pd: PDConfig,
    ) -> PairDecision:
        blocks = query.blocks
        if blocks is None:
            return super().select_pair(query, decodes, prefills, now, pd)
        hashes, tokens = blocks.reusable_hashes, blocks.num_tokens
        self.routing.arrived(now)
        decode = self.routing.best(with_room(decodes), hashes, tokens, blocks.block_size, now)
        cached = decode.prediction.cached_tokens
        local = local_prefill_reason(tokens, cached, bool(prefills), pd)
        if local is not None:
            take_back = self.routing.expect_prefill(decode, hashes, tokens, now)
            matched = _matched(decode, tokens)
            return PairDecision(decode.worker_id, self.name, local, matched, take_back)
        prefill = self.routing.best(prefills, hashes, tokens, blocks.block_size, now)
        # The decode worker holds the whole prompt in its cache while it decodes.
        self.routing.routed(decode.worker_id, tokens)
        both = all_of(
            (
                self.routing.expect_prefill(prefill, hashes, tokens, now),
                self.routing.expect_blocks(decode.worker_id, hashes, now),
            )
        )
        return PairDecision(
            decode.worker_id,
            self.name,
            "remote",
            _matched(prefill, tokens),
            both,
            prefill_worker_id=prefill.worker_id,
        )

    def observe_events(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        self.routing.observe_events(worker_id, events)

    def observe_snapshot(self, worker_id: str, tier: str, block_hashes: Iterable[int]) -> None:
        self.routing.index.replace(worker_id, tier, block_hashes)

    def observe_store(self, worker_id: str, store_id: str | None) -> None:
        self.routing.index.set_store(worker_id, store_id)

    def observe_load(self, load: WorkerLoad) -> None:
        self.routing.loads.update(load)

    def observe_peer_choice(self, choice: ChoiceNote, now: float) -> TakeBack:
        """A peer replica's choice, recorded as this policy records its own: the prefill
        queued on the worker, the prompt's blocks speculated there (only the blocks on a
        PD decode worker, which its prefill worker computes). A choice that computes
        is a request reaching the fleet: counted with this replica's own arrivals (a
        burst split over the replicas shows in their announcements; a pair's decode
        side is the same request, not counted twice)."""
        if not choice.computes:
            return self.routing.expect_blocks(choice.worker_id, choice.block_hashes, now)
        self.routing.arrived(now)
        predicted = Prediction(WorkerLoad(choice.worker_id), choice.cached_tokens, 0.0)
        return self.routing.expect_prefill(
            KvAwareChoice(predicted, "peer"), choice.block_hashes, choice.prompt_tokens, now
        )

    def as_replica(self, replica: str, rank: int) -> None:
        self.routing.as_replica(replica, rank)

    def decision_delay(self, now: float) -> float:
        return self.routing.decision_delay(now)

    def forget_worker(self, worker_id: str) -> None:
        self.routing.forget_worker(worker_id)


def _matched(choice: KvAwareChoice, prompt_tokens: int) -> float:
    return choice.prediction.cached_tokens / prompt_tokens
