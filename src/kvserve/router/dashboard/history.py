"""A few minutes of per-worker totals, sampled every second or so, from which the dashboard
draws TTFT and throughput over time. Cumulative totals are kept rather than rates so a
late or missed sample loses no request: each point is the difference of two samples."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from kvserve.router.dashboard.quantile import histogram_quantile

DEFAULT_WINDOW_S = 300.0


@dataclass(frozen=True, slots=True)
class Totals:
    """One worker's cumulative counts at one sample. ``generation_tokens`` is what the
    worker itself reported (None when it could not be read); ``ttft_buckets`` the
    router's TTFT histogram, (le, cumulative count) ascending."""

    requests: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0
    generation_tokens: float | None = None
    ttft_buckets: tuple[tuple[float, float], ...] = ()


def _delta(new: float, old: float) -> float:
    """A counter's growth; a worker restart resets its counters, which is no negative work."""
    return max(0.0, new - old)


def _point(
    new: Mapping[str, Totals],
    old: Mapping[str, Totals],
    seconds: float,
    *,
    quantiles: bool = False,
) -> dict[str, float | None]:
    """Rates and mean TTFT between two samples over the workers present in both, and with
    ``quantiles`` TTFT p50 and p99 (only for the window: a few dozen additions per
    worker, too many for every point of every series on every refresh)."""
    requests = ttft_sum = ttft_count = tokens = 0.0
    tokens_known = False
    buckets: dict[float, float] = {}
    for worker_id, now in new.items():
        before = old.get(worker_id)
        if before is None:
            continue
        requests += _delta(now.requests, before.requests)
        ttft_sum += _delta(now.ttft_sum_s, before.ttft_sum_s)
        ttft_count += _delta(now.ttft_count, before.ttft_count)
        if now.generation_tokens is not None and before.generation_tokens is not None:
            tokens += _delta(now.generation_tokens, before.generation_tokens)
            tokens_known = True
        if quantiles:
            old_counts = dict(before.ttft_buckets)
            for le, count in now.ttft_buckets:
                buckets[le] = buckets.get(le, 0.0) + _delta(count, old_counts.get(le, 0.0))
    point: dict[str, float | None] = {
        "requests": requests,
        "requests_per_s": requests / seconds if seconds > 0 else 0.0,
        "ttft_mean_s": ttft_sum / ttft_count if ttft_count else None,
        "generation_tokens": tokens if tokens_known else None,
        "tokens_per_s": tokens / seconds if tokens_known and seconds > 0 else None,
    }
    if quantiles:
        ascending = sorted(buckets.items())
        point["ttft_p50_s"] = histogram_quantile(0.5, ascending)
        point["ttft_p99_s"] = histogram_quantile(0.99, ascending)
    return point


class History:
    """Samples of the last ``window_s`` seconds, oldest first."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        self._window_s = window_s
        self._samples: deque[tuple[float, dict[str, Totals]]] = deque()

    def add(self, now: float, totals: Mapping[str, Totals]) -> None:
        self._samples.append((now, dict(totals)))
        while self._samples and self._samples[0][0] < now - self._window_s:
            self._samples.popleft()

    def series(self, worker_ids: list[str]) -> dict[str, object]:
        """Per-interval points for the fleet and each worker (``t``: seconds before the
        newest sample, so the page needs no clock of its own), and each one's figures
        over the whole window (``window``; None until two samples exist)."""
        samples = list(self._samples)
        pairs = list(itertools.pairwise(samples))
        newest = samples[-1][0] if samples else 0.0

        def scope(members: list[str]) -> dict[str, object]:
            def only(totals: dict[str, Totals]) -> dict[str, Totals]:
                return {w: totals[w] for w in members if w in totals}

            points = [_point(only(new), only(old), t1 - t0) for (t0, old), (t1, new) in pairs]
            window = None
            if pairs:
                window = _point(
                    only(samples[-1][1]), only(samples[0][1]), self.span_s(), quantiles=True
                )
            return {
                "requests_per_s": [p["requests_per_s"] for p in points],
                "ttft_mean_s": [p["ttft_mean_s"] for p in points],
                "tokens_per_s": [p["tokens_per_s"] for p in points],
                "window": window,
            }

        return {
            "t": [round(t - newest, 3) for _, (t, _) in pairs],
            "span_s": self.span_s(),
            "fleet": scope(worker_ids),
            "workers": {w: scope([w]) for w in worker_ids},
        }

    def span_s(self) -> float:
        """Seconds between the oldest and newest sample kept."""
        return self._samples[-1][0] - self._samples[0][0] if len(self._samples) > 1 else 0.0
