"""Whether the requests a router replica knows of are arriving in bursts.

A replica's salt (:class:`~kvserve.core.routing.tie_breaking.ReplicaSalt`) breaks herds:
requests reaching several replicas within one announcement delay are each routed
without the others' choices, to the same best worker. It has a price where there is no
herd to break: a salted choice may leave the deepest holder for a near-equal worker
(measured with arrivals spread as a real stream's are, 10 workers, 4 replicas: hit rate
5.8 % below one router's salted, level unsalted; docs/benchmarks.md, "Salting only
bursts"). A replica knows of its own requests as they arrive and of its peers' as their
choices are announced: when most of the recent ones came within ``window_s`` of the one
before, the traffic comes in bursts, and its peers are taking the same burst. The same
gate keeps a replica's turn in a burst (``KvAwareRouting.decision_delay``) to bursts: a
stream spread in time has been heard, and waiting would only add to its TTFT.
"""

from __future__ import annotations

from collections import deque

RECENT_GAPS = 8  # how many of the latest gaps between arrivals are looked at


class ArrivalBursts:
    """The gaps between the last :data:`RECENT_GAPS` arrivals a replica knows of (its own
    and its peers' announced); ``bursting`` when at least half of them are under
    ``window_s`` (never before a second arrival)."""

    __slots__ = ("_gaps", "_last", "_short", "window_s")

    def __init__(self, window_s: float) -> None:
        if window_s < 0:
            raise ValueError("window_s must be >= 0")
        self.window_s = window_s
        self._gaps: deque[bool] = deque(maxlen=RECENT_GAPS)  # each gap: under the window?
        self._short = 0  # how many of them are
        self._last: float | None = None

    def arrived(self, now: float) -> None:
        """A request reached this replica, or a peer's choice was heard, at ``now``."""
        if self._last is not None:
            gaps = self._gaps
            if len(gaps) == RECENT_GAPS:
                self._short -= gaps[0]
            short = now - self._last < self.window_s
            gaps.append(short)
            self._short += short
        self._last = now

    @property
    def bursting(self) -> bool:
        gaps = len(self._gaps)
        return gaps > 0 and 2 * self._short >= gaps
