"""Labelled counters and histograms for metrics updated on the router's event loop only.

``prometheus_client``'s own take a lock on every update (its values may be shared between
threads); the proxy updates six of them per request on one thread, where that lock is
pure cost. These keep plain numbers per label set and hand them to the registry as
ordinary metric families when scraped, so ``/metrics`` and
``dashboard/router_figures.py`` read them exactly as they read prometheus_client's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector


class CounterChild:
    """One label set's count."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    """One label set's observations: a count per bucket (not cumulative) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: bound >= value
        self.total += value


class LoopCounter(Collector):
    """A labelled counter; ``labels(...)`` returns the label set's child, made once."""

    def __init__(
        self, name: str, doc: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self._name, self._doc, self._labelnames = name, doc, list(labelnames)
        self._children: dict[tuple[str, ...], CounterChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> CounterChild:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = CounterChild()
        return child

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        for values, child in self._children.items():
            family.add_metric(list(values), child.value)
        yield family


class LoopHistogram(Collector):
    """A labelled histogram with fixed bucket bounds (``+Inf`` is added)."""

    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        self._name, self._doc, self._labelnames = name, doc, list(labelnames)
        self._bounds = tuple(sorted(float(b) for b in buckets))
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = HistogramChild(self._bounds)
        return child

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        names = [repr(b) for b in self._bounds] + ["+Inf"]  # as prometheus_client writes them
        for values, child in self._children.items():
            cumulative, buckets = 0, []
            for le, count in zip(names, child.counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(list(values), buckets, child.total)
        yield family
