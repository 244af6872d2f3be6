"""The dashboard reads a worker's KV figures from the exposition the worker's own
``WorkerMetrics`` renders, and refuses one that is not a kvserve worker's."""

from __future__ import annotations

import pytest

from kvserve.router.dashboard.worker_report import parse_worker_metrics
from kvserve.worker.engine_state import EngineState
from kvserve.worker.metrics import WorkerMetrics

STATE = EngineState(
    running=1,
    waiting=2,
    free_blocks=10,
    cached_blocks=5,
    total_blocks=16,
    prefill_tokens=7,
    prefix_queried_tokens=100,
    prefix_hit_tokens=40,
    preemptions=3,
    kv_tiers=(("host_blocks", 4), ("host_capacity_blocks", 8), ("host_hit_tokens", 32)),
)


def test_a_workers_exposition_reads_back_as_its_state() -> None:
    text = WorkerMetrics(lambda: STATE).render().decode()
    report = parse_worker_metrics(text, scraped_at=12.5)
    described = report.describe()
    assert described["blocks"] == {"used": 6, "cached": 5, "free": 10, "total": 16}
    assert described["host_tier"] == {"blocks": 4, "capacity": 8}
    assert described["prefix_cache"] == {"queried_tokens": 100, "hit_tokens": 40, "hit_rate": 0.4}
    assert (report.running, report.waiting, report.prefill_tokens) == (1, 2, 7)
    assert (report.preemptions, report.generation_tokens, report.scraped_at) == (3, 0, 12.5)
    assert report.tiers["host_hit_tokens_total"] == 32


def test_without_tiers_there_is_no_host_tier() -> None:
    text = WorkerMetrics(lambda: EngineState(total_blocks=4, free_blocks=4)).render().decode()
    described = parse_worker_metrics(text, scraped_at=0.0).describe()
    assert described["host_tier"] is None
    assert described["prefix_cache"]["hit_rate"] is None  # type: ignore[index]


def test_another_servers_exposition_is_refused() -> None:
    other = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3.0\n"
    with pytest.raises(KeyError):
        parse_worker_metrics(other, scraped_at=0.0)
