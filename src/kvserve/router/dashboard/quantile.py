"""Quantiles of a Prometheus histogram, computed as PromQL's ``histogram_quantile`` does, so
the dashboard's TTFT p50/p99 read like the Grafana panels' over the same window."""

from __future__ import annotations

import math
from collections.abc import Sequence


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """``buckets``: (upper bound ``le``, cumulative count), ascending, ending with +Inf.
    Linear within the bucket holding the rank; a rank in the +Inf bucket answers the
    highest finite bound. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower
