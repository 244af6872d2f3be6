"""The dashboard's history: rates and mean TTFT between samples of cumulative totals."""

from __future__ import annotations

import pytest

from kvserve.router.dashboard.history import History, Totals


def test_points_are_differences_of_consecutive_samples() -> None:
    history = History(window_s=60)
    history.add(0.0, {"w0": Totals(generation_tokens=0), "w1": Totals()})
    history.add(2.0, {"w0": Totals(4, 0.4, 4, 100), "w1": Totals(2, 0.6, 2, None)})
    history.add(3.0, {"w0": Totals(4, 0.4, 4, 130), "w1": Totals(3, 0.9, 3, None)})
    series = history.series(["w0", "w1"])
    assert series["t"] == [-1.0, 0.0]
    w0, fleet = series["workers"]["w0"], series["fleet"]  # type: ignore[index]
    assert w0["requests_per_s"] == [2.0, 0.0]
    assert w0["ttft_mean_s"] == [0.1, None]  # no request in the second interval
    assert w0["tokens_per_s"] == [50.0, 30.0]
    assert series["workers"]["w1"]["tokens_per_s"] == [None, None]  # type: ignore[index]
    assert fleet["requests_per_s"] == [3.0, 1.0]
    assert fleet["ttft_mean_s"] == pytest.approx([1.0 / 6, 0.3])
    assert fleet["window"] == pytest.approx(
        {
            "requests": 7.0,
            "requests_per_s": 7.0 / 3,
            "ttft_mean_s": 1.3 / 7,
            "generation_tokens": 130.0,  # the workers that reported tokens
            "tokens_per_s": 130.0 / 3,
            "ttft_p50_s": None,  # these samples carry no TTFT buckets
            "ttft_p99_s": None,
        }
    )


def test_a_worker_restart_counts_no_negative_work_and_a_new_worker_joins_later() -> None:
    history = History(window_s=60)
    history.add(0.0, {"w0": Totals(10, 1.0, 10, 500)})
    history.add(1.0, {"w0": Totals(11, 1.5, 11, 2), "w2": Totals(5, 5.0, 5, 5)})
    fleet = history.series(["w0", "w2"])["fleet"]
    assert fleet["requests_per_s"] == [1.0]  # type: ignore[index]
    assert fleet["tokens_per_s"] == [0.0]  # type: ignore[index]
    assert fleet["ttft_mean_s"] == [0.5]  # type: ignore[index]


def test_samples_older_than_the_window_are_dropped() -> None:
    history = History(window_s=10)
    for second in range(30):
        history.add(float(second), {"w0": Totals(requests=second)})
    series = history.series(["w0"])
    assert series["span_s"] == 10.0
    assert len(series["t"]) == 10  # type: ignore[arg-type]
    assert series["fleet"]["window"]["requests"] == 10.0  # type: ignore[index]
    assert History().series(["w0"])["fleet"]["window"] is None  # type: ignore[index]


def test_window_quantiles_come_from_the_buckets_of_every_worker() -> None:
    history = History(window_s=60)
    empty = ((0.1, 0.0), (1.0, 0.0), (float("inf"), 0.0))
    history.add(0.0, {"w0": Totals(ttft_buckets=empty), "w1": Totals(ttft_buckets=empty)})
    w0 = ((0.1, 3.0), (1.0, 4.0), (float("inf"), 4.0))  # 3 under 100 ms, 1 under 1 s
    w1 = ((0.1, 0.0), (1.0, 0.0), (float("inf"), 1.0))  # 1 over 1 s
    history.add(1.0, {"w0": Totals(ttft_buckets=w0), "w1": Totals(ttft_buckets=w1)})
    series = history.series(["w0", "w1"])
    fleet = series["fleet"]["window"]  # type: ignore[index]
    assert fleet["ttft_p50_s"] == pytest.approx(0.1 * 2.5 / 3)  # rank 2.5 of 5, first bucket
    assert fleet["ttft_p99_s"] == 1.0  # in the +Inf bucket: the highest finite bound
    w0_window = series["workers"]["w0"]["window"]  # type: ignore[index]
    assert w0_window["ttft_p99_s"] == pytest.approx(0.1 + 0.9 * (3.96 - 3) / 1)
