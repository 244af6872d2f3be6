"""The router's loop-only counters and histograms expose exactly what prometheus_client's
own would for the same updates (its ``_created`` timestamps aside)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvserve.router.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.005, 0.01, 0.5, 1, 300)


def _exposition(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def test_same_exposition_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counters = [
        LoopCounter("c", "A counter.", ["worker", "status"], ours),
        Counter("c", "A counter.", ["worker", "status"], registry=theirs),
    ]
    histograms = [
        LoopHistogram("h_seconds", "A histogram.", ["worker"], ours, BUCKETS),
        Histogram("h_seconds", "A histogram.", ["worker"], registry=theirs, buckets=BUCKETS),
    ]
    for counter in counters:
        counter.labels("w0", "200").inc()
        counter.labels("w0", "200").inc(2.5)
        counter.labels("w1", "503").inc()
    for histogram in histograms:
        # on a bound, between bounds, past the last one, and zero
        for value in (0.005, 0.007, 0.5, 2.0, 1000.0, 0.0):
            histogram.labels("w0").observe(value)
        histogram.labels("w1").observe(0.2)
    assert _exposition(ours) == _exposition(theirs)
