"""Cache-aware routing over an approximate prefix tree learned from routing history.

See :mod:`kvserve.core.routing.cache_aware` for the rule and how it departs from the
established gateways (ties by load, rotation on a miss, one budget, one tree per pool
and model).

Pair rule (:mod:`kvserve.core.routing.pd_pair`'s ``select_pair_from_matches``), each pool with its
own tree: the decode worker with KV room, then fewer in-flight requests, then the deeper
match in the decode pool's tree; local prefill when that match covers most of the prompt
or the prompt is short; else the prefill worker with the least predicted prefill time
(queued prefill tokens + the part its pool's tree does not hold).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.routing.announcements import ChoiceNote
from kvserve.core.routing.approximate_tree import ApproximatePrefixTree
from kvserve.core.routing.cache_aware import CacheAwareConfig, CacheAwareIndex, select_worker
from kvserve.core.routing.pd_pair import (
    DECODE_POOL,
    PREFILL_POOL,
    DecodeCandidate,
    PDConfig,
    select_pair_from_matches,
)
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.tie_breaking import PoolRotations
from kvserve.core.routing.types import (
    PairDecision,
    RouteQuery,
    RoutingDecision,
    TakeBack,
    WorkerLoad,
    all_of,
)


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    peer_choice_input = "text"

    def __init__(self, config: CacheAwareConfig, now: float) -> None:
        self._config = config
        self._index = CacheAwareIndex(config, now)
        self._rotations = PoolRotations()

    @property
    def index(self) -> CacheAwareIndex:
        return self._index

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        self._index.maybe_trim(now)
        tree = self._index.tree(query.pool, query.model)
        walk = tree.walk(query.text)
        matched = walk.matched()
        choice = select_worker(
            workers, matched, len(query.text), self._config, self._rotations[query.pool]
        )
        worker_id = choice.worker.worker_id
        tree.insert_walked(walk, worker_id, now)  # the tree has not changed since the walk
        take_back = _untag(tree, query.text, worker_id, matched.get(worker_id, 0))
        return RoutingDecision(
            worker_id, self.name, choice.reason, choice.matched_fraction, take_back
        )

    def select_pair(
        self,
        query: RouteQuery,
        decodes: Sequence[WorkerLoad],
        prefills: Sequence[WorkerLoad],
        now: float,
        pd: PDConfig,
    ) -> PairDecision:
        self._index.maybe_trim(now)
        decode_tree = self._index.tree(DECODE_POOL, query.model)
        prefill_tree = self._index.tree(PREFILL_POOL, query.model)
        text_chars = max(1, len(query.text))
        decode_matched = decode_tree.match(query.text)
        prefill_matched = {w: c / text_chars for w, c in prefill_tree.match(query.text).items()}
        candidates = [
            DecodeCandidate(w, w.kv_free_fraction, decode_matched.get(w.worker_id, 0) / text_chars)
            for w in decodes
        ]
        pair = select_pair_from_matches(
            candidates,
            prefills,
            prefill_matched,
            query.prefill_tokens,
            pd,
            self._rotations[DECODE_POOL],
        )
        decode_id = pair.decode.load.worker_id
        decode_held = decode_matched.get(decode_id, 0)
        take_back = _insert(decode_tree, query.text, decode_id, decode_held, now)
        if pair.prefill is None:
            matched = pair.decode.matched_fraction
            return PairDecision(decode_id, self.name, pair.reason, matched, take_back)
        prefill_id = pair.prefill.worker_id
        prefill_held = round(prefill_matched.get(prefill_id, 0.0) * text_chars)
        take_backs = (take_back, _insert(prefill_tree, query.text, prefill_id, prefill_held, now))
        return PairDecision(
            decode_id,
            self.name,
            pair.reason,
            pair.prefill_matched_fraction,
            all_of(take_backs),
            prefill_worker_id=prefill_id,
        )

    def observe_peer_choice(self, choice: ChoiceNote, now: float) -> TakeBack | None:
        """A peer replica sent ``choice.text`` to a worker: its tree learns it as if this
        replica had (the approximate tree is routing history; without the peers' it
        knows a fraction of the fleet's)."""
        if not choice.text:
            return None
        tree = self._index.tree(choice.pool, choice.model)
        held = tree.match(choice.text).get(choice.worker_id, 0)
        return _insert(tree, choice.text, choice.worker_id, held, now)

    def forget_worker(self, worker_id: str) -> None:
        self._index.forget_worker(worker_id)


def _insert(
    tree: ApproximatePrefixTree, text: str, worker_id: str, held_chars: int, now: float
) -> TakeBack:
    """Record ``text`` as sent to ``worker_id``, which held ``held_chars`` of it before;
    returns what takes that back (only the part it did not hold)."""
    tree.insert(text, worker_id, now)
    return _untag(tree, text, worker_id, held_chars)


def _untag(tree: ApproximatePrefixTree, text: str, worker_id: str, held_chars: int) -> TakeBack:
    """What takes back ``text``'s insertion for ``worker_id`` (which held ``held_chars``)."""
    return lambda _: tree.untag(text, worker_id, held_chars)
