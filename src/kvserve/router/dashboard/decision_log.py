"""The last routing decisions, kept so that an operator can see *why* requests went where
they did; the counters in ``/metrics`` say how often, not which request or how well it
matched."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from kvserve.core.routing.types import PairDecision, RoutingDecision

DEFAULT_CAPACITY = 50


class DecisionLog:
    """A bounded ring: one append per decision on the request path, nothing else."""

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.time
    ) -> None:
        self._ring: deque[tuple[float, RoutingDecision]] = deque(maxlen=capacity)
        self._clock = clock

    def record(self, decision: RoutingDecision) -> None:
        self._ring.append((self._clock(), decision))

    def recent(self) -> list[dict[str, object]]:
        """Newest first, as the dashboard lists them. ``prefill_worker`` is the PD pair's
        prefill worker (None when the decode worker prefills, or outside PD mode)."""
        return [
            {
                "time": at,
                "worker": decision.worker_id,
                "policy": decision.policy,
                "reason": decision.reason,
                "matched_fraction": decision.matched_fraction,
                "prefill_worker": (
                    decision.prefill_worker_id if isinstance(decision, PairDecision) else None
                ),
            }
            for at, decision in reversed(self._ring)
        ]
