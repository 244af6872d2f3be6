"""A multi-process router's ``/metrics``: counters and histograms summed over the
processes, gauges the answering process's own, a silent sibling left out, not waited on."""

from __future__ import annotations

import asyncio
import socket
import time

from prometheus_client import Gauge
from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.metrics import RouterMetrics
from kvserve.router.sibling_links import SiblingLinks
from kvserve.router.sibling_metrics import SiblingMetrics


def _values(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def _metrics(requests: int, ttft_s: float, healthy: int) -> RouterMetrics:
    metrics = RouterMetrics()
    for _ in range(requests):
        metrics.worker("w0").requests(200).inc()
        metrics.worker("w0").ttft.observe(ttft_s)
    metrics.worker_healthy.labels("w0").set(healthy)
    return metrics


def _scraped_with_a_sibling(a_metrics: RouterMetrics, b_metrics: RouterMetrics) -> bytes:
    """Process a's answer to a scrape, with b its one sibling."""

    async def scenario() -> bytes:
        links_a, links_b = (SiblingLinks([end]) for end in socket.socketpair())
        a = SiblingMetrics(links_a, a_metrics.registry)
        b = SiblingMetrics(links_b, b_metrics.registry)
        await links_a.start(a.on_message)
        await links_b.start(b.on_message)
        text = await a.render()
        links_a.close()
        links_b.close()
        return text

    return asyncio.run(scenario())


def test_counts_are_summed_and_gauges_are_the_answering_process_own() -> None:
    b_metrics = _metrics(3, 2.0, 0)
    b_metrics.decisions.labels("kv_aware", "cache_hit").inc(7)  # a series only b has
    values = _values(_scraped_with_a_sibling(_metrics(2, 0.02, 1), b_metrics))
    assert values[("kvserve_router_requests_total", (("status", "200"), ("worker", "w0")))] == 5
    assert values[("kvserve_router_ttft_seconds_count", (("worker", "w0"),))] == 5
    assert values[("kvserve_router_ttft_seconds_sum", (("worker", "w0"),))] == 2 * 0.02 + 3 * 2.0
    bucket = ("kvserve_router_ttft_seconds_bucket", (("le", "0.025"), ("worker", "w0")))
    assert values[bucket] == 2  # only a's observations are that fast
    hits = ("kvserve_router_decisions_total", (("policy", "kv_aware"), ("reason", "cache_hit")))
    assert values[hits] == 7
    assert values[("kvserve_router_worker_healthy", (("worker", "w0"),))] == 1  # a's, not 1 + 0
    assert values[("kvserve_router_metrics_processes_answered", ())] == 2


def test_a_sibling_that_does_not_answer_is_left_out_after_the_timeout() -> None:
    async def scenario() -> tuple[bytes, float]:
        left, right = socket.socketpair()  # nobody reads ``right``
        links_a = SiblingLinks([left])
        a = SiblingMetrics(links_a, _metrics(2, 0.02, 1).registry, timeout_s=0.2)
        await links_a.start(a.on_message)
        started = time.monotonic()
        text = await a.render()
        took = time.monotonic() - started
        links_a.close()
        right.close()
        return text, took

    text, took = asyncio.run(scenario())
    values = _values(text)
    assert values[("kvserve_router_requests_total", (("status", "200"), ("worker", "w0")))] == 2
    assert values[("kvserve_router_metrics_processes_answered", ())] == 1
    assert took < 5  # the timeout, not a hang


def test_a_gauge_of_a_sibling_is_not_added_even_where_this_process_lacks_it() -> None:
    b_metrics = _metrics(1, 0.02, 1)
    Gauge("only_in_b", "a gauge", registry=b_metrics.registry).set(5)
    text = _scraped_with_a_sibling(_metrics(1, 0.02, 1), b_metrics)
    assert ("only_in_b", ()) not in _values(text)
