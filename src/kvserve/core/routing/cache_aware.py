"""The cache-aware rule and its index, as the established gateways define them, fixed.

Rule (SGLang model gateway semantics, same parameters and defaults):

1. If the fleet is imbalanced (``max - min > balance_abs_threshold`` and
   ``max > balance_rel_threshold * min``, in in-flight requests), go to the least-loaded
   worker: a hot cache is worth nothing behind a long queue.
2. Else, if the deepest match covers more than ``cache_threshold`` of the prompt, go to a
   worker holding that match — the least-loaded of them (the gateways take any).
3. Else (a miss), go to the least-loaded worker; ties rotate instead of always landing
   on the same worker.

The index keeps one tree per (pool, model), so that one pool's history never steers
another's, under one character budget for all trees (the gateways' budget is per worker,
which grows with the fleet).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvserve.core.routing.approximate_tree import ApproximatePrefixTree
from kvserve.core.routing.tie_breaking import Rotation, least_loaded
from kvserve.core.routing.types import WorkerLoad


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """Defaults are SGLang's gateway CLI defaults, so results compare like for like."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 60.0
    max_tree_size: int = 2**26  # characters, for the whole index

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance thresholds must be >= 0 (absolute) and >= 1 (relative)")
        if self.eviction_interval_s <= 0 or self.max_tree_size <= 0:
            raise ValueError("eviction interval and max tree size must be positive")


class CacheAwareChoice(NamedTuple):
    """A tuple, not a frozen dataclass: it is made on every request, and a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``."""

    worker: WorkerLoad
    reason: str  # "load_imbalance" | "cache_hit" | "cache_miss"
    matched_fraction: float  # of the prompt, on the chosen worker


def _imbalanced(most: int, least: int, config: CacheAwareConfig) -> bool:
    return (
        most - least > config.balance_abs_threshold and most > config.balance_rel_threshold * least
    )


def select_worker(
    workers: Sequence[WorkerLoad],
    matched_chars: Mapping[str, int],
    prompt_chars: int,
    config: CacheAwareConfig,
    rotation: Rotation,
) -> CacheAwareChoice:
    """Apply the rule to ``workers`` (non-empty) given each one's matched prefix length.

    Written for the request path: one plain loop reads the loads and the deepest match
    (for a handful of workers, comprehensions, generators and a closure cost more than
    the rule itself)."""
    get = matched_chars.get
    most = least = workers[0].in_flight_requests
    deepest = 0
    for worker in workers:
        requests = worker.in_flight_requests
        if requests > most:
            most = requests
        elif requests < least:
            least = requests
        depth = get(worker.worker_id, 0)
        if depth > deepest:
            deepest = depth
    if _imbalanced(most, least, config):
        chosen, reason = least_loaded(workers, rotation), "load_imbalance"
    elif prompt_chars and deepest / prompt_chars > config.cache_threshold:
        holders = [w for w in workers if get(w.worker_id, 0) == deepest]
        chosen, reason = least_loaded(holders, rotation), "cache_hit"
    else:
        chosen, reason = least_loaded(workers, rotation), "cache_miss"
    matched = get(chosen.worker_id, 0) / prompt_chars if prompt_chars else 0.0
    return CacheAwareChoice(chosen, reason, matched)


class CacheAwareIndex:
    """One approximate tree per (pool, model) under one shared character budget.

    Trees are trimmed to the budget every ``eviction_interval_s`` (as the gateways do), and
    at once if they reach twice the budget, so memory stays bounded under any burst.
    Each tree gives up the same fraction of its size, least recently used first.
    """

    def __init__(self, config: CacheAwareConfig, now: float) -> None:
        self._config = config
        self._trees: dict[tuple[str, str], ApproximatePrefixTree] = {}
        self._last_trim = now

    @property
    def size_chars(self) -> int:
        return sum(tree.size_chars for tree in self._trees.values())

    def tree(self, pool: str, model: str) -> ApproximatePrefixTree:
        tree = self._trees.get((pool, model))
        if tree is None:  # not setdefault: that would build a tree per request to drop
            tree = self._trees[(pool, model)] = ApproximatePrefixTree()
        return tree

    def forget_worker(self, worker_id: str) -> None:
        for tree in self._trees.values():
            tree.remove_tenant(worker_id)

    def maybe_trim(self, now: float) -> int:
        """Trim when the interval has passed or the hard ceiling is hit; chars evicted.

        Called on every request: the sizes are summed in a plain loop (a generator over
        the trees' sizes cost more than the rest of the check)."""
        budget = self._config.max_tree_size
        total = 0
        for tree in self._trees.values():
            total += tree.size_chars
        if total < 2 * budget and now - self._last_trim < self._config.eviction_interval_s:
            return 0
        self._last_trim = now
        if total <= budget:
            return 0
        keep = budget / total
        return sum(tree.evict_to(int(tree.size_chars * keep)) for tree in self._trees.values())
