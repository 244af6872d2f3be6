"""Figures computed exactly from per-request records."""

from __future__ import annotations

import pytest

from kvserve.bench.metrics import RequestRecord, percentiles, summarize, time_series


def record(item: int, **fields) -> RequestRecord:
    return RequestRecord(item=item, turn=0, start_s=float(item), **fields)


def test_percentiles_are_exact() -> None:
    result = percentiles([float(v) for v in range(1, 101)], scale=1000.0)
    expected = {"p50": 50500.0, "p90": 90100.0, "p99": 99010.0, "mean": 50500.0}
    assert result == pytest.approx(expected)
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_summary_counts_hit_rate_and_throughput_over_successes_only() -> None:
    ok = dict(ttft_s=0.1, e2e_s=1.0, itl_s=[0.02, 0.04], completion_tokens=10)
    records = [
        record(0, prompt_tokens=100, cached_tokens=0, worker="a", **ok),
        record(1, prompt_tokens=100, cached_tokens=80, worker="b", **ok),
        record(2, prompt_tokens=50, cached_tokens=50, worker="a", **ok),
        record(3, prompt_tokens=999, error="HTTP 503: busy", status=503),
    ]
    summary = summarize(records, duration_s=4.0)
    assert (summary["requests"], summary["ok"], summary["errors"]) == (4, 3, 1)
    assert summary["error_rate"] == 0.25
    assert summary["prefix_hit_rate"] == pytest.approx(130 / 250)
    assert summary["request_throughput"] == 0.75
    assert summary["output_token_throughput"] == 7.5
    assert summary["itl_ms"]["p50"] == pytest.approx(30.0)
    assert summary["requests_per_worker"] == {"a": 2, "b": 1}
    assert summary["error_kinds"] == {"HTTP 503": 1}


def test_an_empty_run_summarizes_without_dividing_by_zero() -> None:
    summary = summarize([], duration_s=0.0)
    assert summary["requests"] == 0 and summary["prefix_hit_rate"] is None


def test_time_series_bins_by_completion_time() -> None:
    records = [
        record(0, e2e_s=0.5, completion_tokens=10, prompt_tokens=10, cached_tokens=0),
        record(1, e2e_s=0.5, completion_tokens=20, prompt_tokens=10, cached_tokens=10),
        record(5, e2e_s=1.0, completion_tokens=6, prompt_tokens=4, cached_tokens=2),
    ]
    series = time_series(records, duration_s=5.0, bins=6)
    assert series.bin_s == 1.0
    assert series.output_tokens_per_s == [10.0, 20.0, 0.0, 0.0, 0.0, 6.0]
    assert series.hit_rate == [0.0, 1.0, None, None, None, 0.5]


def test_records_round_trip_through_dicts() -> None:
    original = record(3, ttft_s=0.2, itl_s=[0.1], worker="w", error=None)
    assert RequestRecord.from_dict(original.to_dict()) == original
