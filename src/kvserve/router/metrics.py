"""The router's Prometheus metrics (``kvserve_router_*``), one registry per router app."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserve.core.routing.types import RoutingDecision, WorkerLoad
from kvserve.router.dashboard.decision_log import DecisionLog
from kvserve.router.loop_metrics import CounterChild, HistogramChild, LoopCounter, LoopHistogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _HeldLoadCollector(Collector):
    """The in-flight gauges, computed when scraped: the guards change on every request,
    and setting a gauge each time (a lock and a label lookup) was 3% of the router's CPU
    per request."""

    def __init__(self, loads: Callable[[], Iterable[WorkerLoad]]) -> None:
        self._loads = loads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        requests = GaugeMetricFamily(
            "kvserve_router_in_flight_requests",
            "Requests held by load guards, per worker.",
            labels=["worker"],
        )
        tokens = GaugeMetricFamily(
            "kvserve_router_in_flight_prefill_tokens",
            "Estimated prefill tokens held by load guards (until the first token), per worker.",
            labels=["worker"],
        )
        for load in self._loads():
            requests.add_metric([load.worker_id], load.in_flight_requests)
            tokens.add_metric([load.worker_id], load.in_flight_prefill_tokens)
        yield requests
        yield tokens


class WorkerMetrics:
    """One worker's children of the metrics the proxy updates on every request, looked up
    once: a ``labels()`` lookup per update (five per request) cost more than the update."""

    __slots__ = (
        "_by_status",
        "_requests",
        "_worker_id",
        "e2e",
        "predicted_cached_tokens",
        "reported_cached_tokens",
        "ttft",
    )

    def __init__(self, metrics: RouterMetrics, worker_id: str) -> None:
        self._worker_id = worker_id
        self._requests = metrics.requests
        self._by_status: dict[int, CounterChild] = {}
        self.ttft: HistogramChild = metrics.ttft.labels(worker_id)
        self.e2e: HistogramChild = metrics.e2e.labels(worker_id)
        self.predicted_cached_tokens = metrics.predicted_cached_tokens.labels(worker_id)
        self.reported_cached_tokens = metrics.reported_cached_tokens.labels(worker_id)

    def requests(self, status: int) -> CounterChild:
        """The count of this worker's answers with ``status``."""
        child = self._by_status.get(status)
        if child is None:
            child = self._by_status[status] = self._requests.labels(self._worker_id, str(status))
        return child


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._workers: dict[str, WorkerMetrics] = {}

        def counter(name: str, doc: str, *labels: str) -> LoopCounter:
            return LoopCounter(name, doc, labels, self.registry)

        def histogram(name: str, doc: str, *labels: str) -> LoopHistogram:
            return LoopHistogram(name, doc, labels, self.registry, _LATENCY_BUCKETS)

        self.requests = counter(
            "kvserve_router_requests",
            "Requests answered, by worker and status.",
            "worker",
            "status",
        )
        self.errors = counter(
            "kvserve_router_errors",
            "Failed attempts and rejections, by worker and kind.",
            "worker",
            "kind",
        )
        self.retries = counter(
            "kvserve_router_retries",
            "Attempts retried, by the worker that failed.",
            "worker",
        )
        self.ttft = histogram(
            "kvserve_router_ttft_seconds",
            "Time to the first response byte, per worker.",
            "worker",
        )
        self.e2e = histogram(
            "kvserve_router_e2e_seconds",
            "Time to the last response byte, per worker.",
            "worker",
        )
        self.decisions = counter(
            "kvserve_router_decisions",
            "Routing decisions, by policy and reason.",
            "policy",
            "reason",
        )
        self.predicted_cached_tokens = counter(
            "kvserve_router_predicted_cached_tokens",
            "Prompt tokens the policy expected the worker to hold (matched fraction x prompt).",
            "worker",
        )
        self.reported_cached_tokens = counter(
            "kvserve_router_reported_cached_tokens",
            "Prompt tokens the worker reported as cached (usage.prompt_tokens_details).",
            "worker",
        )
        self.worker_healthy = Gauge(
            "kvserve_router_worker_healthy",
            "1 if the worker passes health checks.",
            ["worker"],
            registry=self.registry,
        )
        self.worker_restarts = counter(
            "kvserve_router_worker_restarts",
            "Times a worker's /health named a new instance: it restarted (a fast-rising "
            "count is a crash loop).",
            "worker",
        )
        self.kv_index_blocks = Gauge(
            "kvserve_router_kv_index_blocks",
            "KV blocks the router's index holds, per worker and tier, as the workers' KV "
            "events and snapshots report them (kv_aware; speculation not counted).",
            ["worker", "tier"],
            registry=self.registry,
        )
        self.recent_decisions = DecisionLog()  # for the dashboard: which request, and why

    def worker(self, worker_id: str) -> WorkerMetrics:
        """``worker_id``'s per-request metrics (kept for a removed worker, as its series
        are: the counts stay on ``/metrics``)."""
        found = self._workers.get(worker_id)
        if found is None:
            found = self._workers[worker_id] = WorkerMetrics(self, worker_id)
        return found

    def record_decision(self, decision: RoutingDecision) -> None:
        """Count a routing decision and keep it among the recent ones."""
        self.decisions.labels(decision.policy, decision.reason).inc()
        self.recent_decisions.record(decision)

    def show_loads(self, loads: Callable[[], Iterable[WorkerLoad]]) -> None:
        """Report the guards' held load as gauges, read from ``loads`` at each scrape."""
        self.registry.register(_HeldLoadCollector(loads))

    def render(self) -> bytes:
        return generate_latest(self.registry)
