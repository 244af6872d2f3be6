"""Same-instant arrivals spread over the gap to the next ones, order and count kept."""

from __future__ import annotations

from kvserve.sim.arrival_spread import spread_arrivals
from kvserve.sim.trace import TraceRequest


def request(index: int, at: float) -> TraceRequest:
    return TraceRequest(f"r{index}", at, 10, 1, (index,))


def test_each_bucket_spreads_over_the_gap_to_the_next() -> None:
    trace = [request(0, 0.0), request(1, 0.0), request(2, 0.0), request(3, 3.0), request(4, 6.0)]
    spread = spread_arrivals(trace, seed=1)
    assert [r.request_id for r in spread] == [r.request_id for r in trace]
    times = [r.arrival_s for r in spread]
    assert times == sorted(times)
    assert all(0.0 <= t < 3.0 for t in times[:3]) and len(set(times[:3])) == 3
    assert times[3:] == [3.0, 6.0]  # alone in their buckets: unchanged
    assert spread_arrivals(trace, seed=1) == spread  # seeded
