"""The router's Prometheus metrics (``kvserve_router_*``), one registry per router app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.core.routing.types import WorkerLoad

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvserve_router_requests",
            "Requests answered, by worker and status.",
            ["worker", "status"],
            registry=r,
        )
        self.errors = Counter(
            "kvserve_router_errors",
            "Failed attempts and rejections, by worker and kind.",
            ["worker", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "kvserve_router_retries",
            "Attempts retried, by the worker that failed.",
            ["worker"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvserve_router_ttft_seconds",
            "Time to the first response byte, per worker.",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvserve_router_e2e_seconds",
            "Time to the last response byte, per worker.",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "kvserve_router_decisions",
            "Routing decisions, by policy and reason.",
            ["policy", "reason"],
            registry=r,
        )
        self.predicted_cached_tokens = Counter(
            "kvserve_router_predicted_cached_tokens",
            "Prompt tokens the policy expected the worker to hold (matched fraction x prompt).",
            ["worker"],
            registry=r,
        )
        self.reported_cached_tokens = Counter(
            "kvserve_router_reported_cached_tokens",
            "Prompt tokens the worker reported as cached (usage.prompt_tokens_details).",
            ["worker"],
            registry=r,
        )
        self.in_flight_requests = Gauge(
            "kvserve_router_in_flight_requests",
            "Requests held by load guards, per worker.",
            ["worker"],
            registry=r,
        )
        self.in_flight_prefill_tokens = Gauge(
            "kvserve_router_in_flight_prefill_tokens",
            "Estimated prefill tokens held by load guards (until the first token), per worker.",
            ["worker"],
            registry=r,
        )
        self.worker_healthy = Gauge(
            "kvserve_router_worker_healthy",
            "1 if the worker passes health checks.",
            ["worker"],
            registry=r,
        )

    def show_load(self, load: WorkerLoad) -> None:
        self.in_flight_requests.labels(load.worker_id).set(load.in_flight_requests)
        self.in_flight_prefill_tokens.labels(load.worker_id).set(load.in_flight_prefill_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
