"""Prometheus metrics of one worker (``kvserve_*``).

Latencies are measured here, on the HTTP side, because that is what a client sees:
time to first token includes queueing and the hop from the engine thread. Engine gauges
and counters come from the latest :class:`EngineState`, read at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.worker.engine_state import EngineState

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class _EngineStateCollector(Collector):
    def __init__(self, read_state: Callable[[], EngineState]) -> None:
        self._read_state = read_state

    def collect(self) -> Iterator[Metric]:
        state = self._read_state()
        gauges = {
            "kvserve_num_requests_running": ("Requests in the running batch.", state.running),
            "kvserve_num_requests_waiting": ("Requests queued for admission.", state.waiting),
            "kvserve_kv_blocks_used": ("KV blocks holding data.", state.used_blocks),
            "kvserve_kv_blocks_free": ("KV blocks in the free pool.", state.free_blocks),
            "kvserve_kv_blocks_cached": ("KV blocks in the prefix tree.", state.cached_blocks),
            "kvserve_kv_blocks_total": ("KV blocks of the device pool.", state.total_blocks),
            "kvserve_prefill_tokens_in_flight": (
                "Prompt tokens admitted but not yet computed.",
                state.prefill_tokens,
            ),
            "kvserve_engine_threads": ("Intra-op threads of the model.", state.threads),
            "kvserve_engine_short_waits": (
                "1 while a CPU engine's threads sleep at once between ops, its cores "
                "shared with other jobs; 0 while they spin through a step.",
                int(state.short_waits),
            ),
        }
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(name, documentation, value=value)
        counters = {
            "kvserve_prefix_cache_queried_tokens": (
                "Prompt tokens of admitted requests (each request once).",
                state.prefix_queried_tokens,
            ),
            "kvserve_prefix_cache_hit_tokens": (
                "Prompt tokens served from the prefix cache (each request once).",
                state.prefix_hit_tokens,
            ),
            "kvserve_num_preemptions": ("Requests preempted.", state.preemptions),
            "kvserve_engine_wait_changes": (
                "Times the engine's threads' waits changed with the sharing of its cores.",
                state.wait_changes,
            ),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(name, documentation, value=value)
        if state.kv_tiers:
            yield from _kv_tier_metrics(state.kv_tiers)


def _kv_tier_metrics(values: tuple[tuple[str, int], ...]) -> Iterator[Metric]:
    """``kvserve_kv_tier_*``: hits, loads, writes and faults of the host and storage tiers
    (names as in :meth:`kvserve.engine.kv_tiers.connector.KVTiers.metrics`)."""
    from kvserve.engine.kv_tiers.connector import FAULT_PREFIX, GAUGES

    faults = CounterMetricFamily(
        "kvserve_kv_tier_faults",
        "Storage tier failures met (served by recomputing), by kind: read, write, corrupt.",
        labels=["kind"],
    )
    for name, value in values:
        if name.startswith(FAULT_PREFIX):
            faults.add_metric([name.removeprefix(FAULT_PREFIX)], value)
        elif name in GAUGES:
            yield GaugeMetricFamily(f"kvserve_kv_tier_{name}", "KV tier occupancy.", value=value)
        else:
            yield CounterMetricFamily(f"kvserve_kv_tier_{name}", "KV tier counter.", value=value)
    yield faults


class WorkerMetrics:
    """The worker's registry: request latencies plus the engine's state."""

    def __init__(self, read_state: Callable[[], EngineState]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStateCollector(read_state))
        self.time_to_first_token = self._latency_histogram(
            "kvserve_time_to_first_token_seconds",
            "From request arrival to its first generated token.",
        )
        self.inter_token_latency = self._latency_histogram(
            "kvserve_inter_token_latency_seconds",
            "Between consecutive outputs of one request, per token.",
        )
        self.e2e_latency = self._latency_histogram(
            "kvserve_e2e_request_latency_seconds", "From request arrival to its last token."
        )
        self.requests_finished = Counter(
            "kvserve_requests",
            "Requests finished, by reason (stop, length, abort).",
            ["finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvserve_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "kvserve_generation_tokens", "Tokens generated.", registry=self.registry
        )
        # n > 1: every choice after a prompt's first is forked from its KV blocks.
        self.forked_choices = Counter(
            "kvserve_forked_choices",
            "Choices (n > 1) started from a sibling's prompt blocks instead of a prefill.",
            registry=self.registry,
        )
        self.forked_prompt_tokens = Counter(
            "kvserve_forked_prompt_tokens",
            "Prompt tokens those forked choices shared with their sibling (not computed).",
            registry=self.registry,
        )

    def _latency_histogram(self, name: str, documentation: str) -> Histogram:
        return Histogram(name, documentation, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def start_request(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Feeds one request's outputs into the latency histograms as they arrive."""

    def __init__(self, metrics: WorkerMetrics, clock: Callable[[], float] = time.perf_counter):
        self._metrics = metrics
        self._clock = clock
        self._arrival = clock()
        self._last_token_time: float | None = None

    def on_output(self, output: Any) -> None:
        now = self._clock()
        num_tokens = len(output.new_token_ids)
        if num_tokens:
            if self._last_token_time is None:
                self._metrics.time_to_first_token.observe(now - self._arrival)
            else:
                gap = (now - self._last_token_time) / num_tokens
                self._metrics.inter_token_latency.observe(gap)
            self._last_token_time = now
            self._metrics.generation_tokens.inc(num_tokens)
        if output.finished:
            self._metrics.e2e_latency.observe(now - self._arrival)
            self._metrics.requests_finished.labels(output.finish_reason or "unknown").inc()
            self._metrics.prompt_tokens.inc(output.prompt_tokens)

    def on_abort(self) -> None:
        self._metrics.requests_finished.labels("abort").inc()
