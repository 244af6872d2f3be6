"""Conditional disaggregation and the (prefill, decode) pair choice."""

from __future__ import annotations

import pytest

from kvserve.core.routing.pd_pair import (
    DecodeCandidate,
    PDConfig,
    prefill_remotely,
    select_pair_from_matches,
)
from kvserve.core.routing.tie_breaking import Rotation
from kvserve.core.routing.types import WorkerLoad

CONFIG = PDConfig(min_remote_prefill_tokens=64, local_hit_fraction=0.8)


@pytest.mark.parametrize(
    ("prompt", "cached", "remote"),
    [(1000, 0, True), (1000, 799, True), (1000, 800, False), (100, 0, True), (63, 0, False)],
)
def test_prefill_goes_remote_only_for_long_uncached_parts(
    prompt: int, cached: int, remote: bool
) -> None:
    assert prefill_remotely(prompt, cached, CONFIG) is remote


def test_decode_with_room_and_fewer_requests_wins_then_the_deeper_match() -> None:
    full = DecodeCandidate(WorkerLoad("d0"), free_fraction=0.01)
    busy = DecodeCandidate(WorkerLoad("d1", in_flight_requests=3))
    idle = DecodeCandidate(WorkerLoad("d2", in_flight_requests=1))
    idle_holder = DecodeCandidate(WorkerLoad("d3", in_flight_requests=1), matched_fraction=0.5)
    prefills = [WorkerLoad("p0")]
    choice = select_pair_from_matches([full, busy, idle], prefills, {}, 1000, CONFIG, Rotation())
    assert choice.decode is idle and choice.reason == "remote"
    choice = select_pair_from_matches(
        [full, busy, idle, idle_holder], prefills, {}, 1000, CONFIG, Rotation()
    )
    assert choice.decode is idle_holder


def test_prefill_by_predicted_prefill_time_with_its_cache() -> None:
    decodes = [DecodeCandidate(WorkerLoad("d0"))]
    queued = WorkerLoad("p0", in_flight_requests=1, in_flight_prefill_tokens=300)
    cold = WorkerLoad("p1")
    # p0 holds 90% of a 1000-token prompt: 300 queued + 100 to compute beats 1000 on p1.
    choice = select_pair_from_matches(
        decodes, [queued, cold], {"p0": 0.9}, 1000, CONFIG, Rotation()
    )
    assert choice.prefill is queued and choice.prefill_matched_fraction == 0.9
    choice = select_pair_from_matches(
        decodes, [queued, cold], {"p0": 0.2}, 1000, CONFIG, Rotation()
    )
    assert choice.prefill is cold


def test_a_decode_holding_the_prompt_or_a_short_prompt_needs_no_prefill_worker() -> None:
    holder = [DecodeCandidate(WorkerLoad("d0"), matched_fraction=0.9)]
    prefills = [WorkerLoad("p0")]
    held = select_pair_from_matches(holder, prefills, {}, 1000, CONFIG, Rotation())
    assert held.prefill is None and held.reason == "local_cached"
    short = select_pair_from_matches(
        [DecodeCandidate(WorkerLoad("d0"))], prefills, {}, 40, CONFIG, Rotation()
    )
    assert short.prefill is None and short.reason == "local_short"
    alone = select_pair_from_matches(
        [DecodeCandidate(WorkerLoad("d0"))], [], {}, 1000, CONFIG, Rotation()
    )
    assert alone.prefill is None and alone.reason == "no_prefill_worker"


def test_ties_rotate_and_bad_settings_are_refused() -> None:
    decodes = [DecodeCandidate(WorkerLoad(f"d{i}")) for i in range(3)]
    rotation = Rotation()
    picked = [
        select_pair_from_matches(decodes, [], {}, 1000, CONFIG, rotation).decode for _ in range(3)
    ]
    assert {c.load.worker_id for c in picked} == {"d0", "d1", "d2"}
    with pytest.raises(ValueError):
        PDConfig(min_remote_prefill_tokens=-1)
    with pytest.raises(ValueError):
        PDConfig(local_hit_fraction=1.5)
