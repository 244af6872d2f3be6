"""The router's own per-worker counters, read from its Prometheus families (its registry's,
or with several processes every process's summed) so that the dashboard and ``/metrics``
can never disagree about them."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.core import Metric

NO_WORKER = "none"  # the ``worker`` label of rejections no worker saw (router/proxy.py)


@dataclass(slots=True)
class WorkerCounts:
    requests_by_status: dict[str, float] = field(default_factory=dict)
    errors_by_kind: dict[str, float] = field(default_factory=dict)
    retries: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0
    ttft_buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count

    @property
    def requests(self) -> float:
        return sum(self.requests_by_status.values())

    @property
    def errors(self) -> float:
        return sum(self.errors_by_kind.values())


@dataclass(slots=True)
class RouterFigures:
    """Per worker id (``none`` for rejections), and decisions by (policy, reason)."""

    workers: defaultdict[str, WorkerCounts] = field(
        default_factory=lambda: defaultdict(WorkerCounts)
    )
    decisions: dict[tuple[str, str], float] = field(default_factory=dict)


def read_router_figures(families: Iterable[Metric]) -> RouterFigures:
    """One pass over the families (microseconds per worker; never on the request path)."""
    figures = RouterFigures()
    for family in families:
        for sample in family.samples:
            labels = sample.labels
            worker = labels.get("worker", NO_WORKER)
            match sample.name:
                case "kvserve_router_requests_total":
                    figures.workers[worker].requests_by_status[labels["status"]] = sample.value
                case "kvserve_router_errors_total":
                    figures.workers[worker].errors_by_kind[labels["kind"]] = sample.value
                case "kvserve_router_retries_total":
                    figures.workers[worker].retries = sample.value
                case "kvserve_router_ttft_seconds_sum":
                    figures.workers[worker].ttft_sum_s = sample.value
                case "kvserve_router_ttft_seconds_bucket":
                    figures.workers[worker].ttft_buckets[float(labels["le"])] = sample.value
                case "kvserve_router_ttft_seconds_count":
                    figures.workers[worker].ttft_count = sample.value
                case "kvserve_router_decisions_total":
                    figures.decisions[(labels["policy"], labels["reason"])] = sample.value
    return figures
