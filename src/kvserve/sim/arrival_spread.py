"""Spreading a trace's same-instant arrivals over the time until the next arrival.

The Mooncake conversation trace stamps its arrivals in 3-second buckets: about ten
requests share each timestamp. Replayed as is, they reach the router at the very same
instant, a burst no real fleet sees and one that no announcement between router replicas
can reach in time (any delay above zero leaves each replica blind to the others' choices
within the burst). Spreading each bucket's requests uniformly at random (seeded) over the
gap to the next timestamp keeps the trace's rate per bucket and its order of
conversations, and gives the arrivals the gaps a real stream would have.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence

from kvserve.sim.trace import TraceRequest


def spread_arrivals(requests: Sequence[TraceRequest], seed: int = 0) -> list[TraceRequest]:
    """``requests`` (in arrival order) with each group of equal arrival times spread over
    ``[time, next group's time)``; the last group keeps its time. Order is kept."""
    rng = random.Random(seed)
    groups = [list(g) for _, g in itertools.groupby(requests, key=lambda r: r.arrival_s)]
    spread: list[TraceRequest] = []
    for group, following in zip(groups, [*groups[1:], None], strict=True):
        start = group[0].arrival_s
        gap = 0.0 if following is None else following[0].arrival_s - start
        offsets = sorted(rng.uniform(0.0, gap) for _ in group) if len(group) > 1 else [0.0]
        spread += [
            dataclasses.replace(r, arrival_s=start + offset)
            for r, offset in zip(group, offsets, strict=True)
        ]
    return spread
