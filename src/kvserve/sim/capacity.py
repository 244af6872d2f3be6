"""The capacity question: the highest arrival-rate multiple at which a policy still meets
a p99 TTFT target ("how much traffic does this fleet take").

p99 TTFT grows with the arrival rate (more load, longer queues), so the answer is found by
search over the trace's speed-up: double (or halve) from ×1 until the target flips, then
bisect between the last rate that met it and the first that did not. Each probe is one
whole simulation, so the search stops at a relative ``tolerance`` and within
``[min_rate, max_rate]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """``max_rate``: the highest multiple found to meet the target (None: not even
    ``min_rate``; equal to ``max_rate`` searched: met everywhere searched).
    ``probes``: every (rate, p99 TTFT) simulated, in order."""

    max_rate: float | None
    probes: list[tuple[float, float]] = field(default_factory=list)


def find_max_rate(
    p99_at: Callable[[float], float],
    slo_s: float,
    min_rate: float = 1 / 16,
    max_rate: float = 64.0,
    tolerance: float = 0.1,
) -> CapacityResult:
    """Search ``p99_at(rate)`` (p99 TTFT in seconds at ``rate`` × the trace's arrivals)
    for the highest rate with p99 <= ``slo_s``."""
    if not 0 < min_rate <= 1 <= max_rate:
        raise ValueError("need 0 < min_rate <= 1 <= max_rate")
    if tolerance <= 0:
        raise ValueError("tolerance must be > 0")
    probes: list[tuple[float, float]] = []

    def meets(rate: float) -> bool:
        p99 = p99_at(rate)
        probes.append((rate, p99))
        return p99 <= slo_s

    if meets(1.0):
        good, bad = 1.0, None
        while good < max_rate:
            rate = min(good * 2, max_rate)
            if not meets(rate):
                bad = rate
                break
            good = rate
        if bad is None:
            return CapacityResult(good, probes)
    else:
        good, bad = None, 1.0
        while bad > min_rate:
            rate = max(bad / 2, min_rate)
            if meets(rate):
                good = rate
                break
            bad = rate
        if good is None:
            return CapacityResult(None, probes)
    assert good is not None and bad is not None  # each branch returned when one was missing
    while bad / good > 1 + tolerance:
        rate = (good * bad) ** 0.5  # the rates double: bisect their logarithm
        if meets(rate):
            good = rate
        else:
            bad = rate
    return CapacityResult(good, probes)
