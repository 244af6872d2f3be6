"""The capacity search: highest arrival-rate multiple meeting a p99 TTFT target."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvserve.sim.capacity import find_max_rate


def knee(at: float) -> Callable[[float], float]:
    """p99 TTFT that passes 1 s exactly at rate ``at`` and grows with the rate."""
    return lambda rate: rate / at


@pytest.mark.parametrize("at", [0.3, 1.0, 2.5, 7.0])
def test_finds_the_knee_within_the_tolerance(at: float) -> None:
    result = find_max_rate(knee(at), slo_s=1.0, tolerance=0.05)
    assert result.max_rate is not None
    assert at / 1.05 <= result.max_rate <= at
    assert all(p99 == pytest.approx(rate / at) for rate, p99 in result.probes)


def test_never_met_and_always_met_are_said_so() -> None:
    never = find_max_rate(lambda rate: 5.0, slo_s=2.0, min_rate=0.25)
    assert never.max_rate is None
    assert [rate for rate, _ in never.probes] == [1.0, 0.5, 0.25]
    always = find_max_rate(lambda rate: 0.1, slo_s=2.0, max_rate=8.0)
    assert always.max_rate == 8.0


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_rate"):
        find_max_rate(knee(1.0), slo_s=1.0, min_rate=2.0)
    with pytest.raises(ValueError, match="tolerance"):
        find_max_rate(knee(1.0), slo_s=1.0, tolerance=0.0)
