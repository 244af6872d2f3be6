"""Load guards: counted on acquire, released exactly once, prefill released at first token."""

from __future__ import annotations

import pytest

from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad
from kvserve.router.load_guard import LoadTracker
from kvserve.router.proxy import guarded_prefill_tokens


def test_guard_holds_request_and_prefill_until_released() -> None:
    seen: list[WorkerLoad] = []
    tracker = LoadTracker(on_change=seen.append)
    guard = tracker.acquire("w0", prefill_tokens=100)
    other = tracker.acquire("w0", prefill_tokens=20)
    assert tracker.load("w0") == WorkerLoad("w0", 2, 120)
    guard.release_prefill()
    guard.release_prefill()
    assert tracker.load("w0") == WorkerLoad("w0", 2, 20)
    guard.release()
    guard.release()
    other.release()
    assert tracker.load("w0") == WorkerLoad("w0", 0, 0)
    assert tracker.total_held() == WorkerLoad("*", 0, 0)
    assert seen[-1] == WorkerLoad("w0", 0, 0)


def test_release_without_first_token_returns_the_prefill_too() -> None:
    tracker = LoadTracker()
    guard = tracker.acquire("w1", prefill_tokens=50)
    guard.release()
    guard.release_prefill()
    assert tracker.load("w1") == WorkerLoad("w1", 0, 0)
    assert guard.released and guard.prefill_released


def test_over_release_is_an_error_not_a_negative_gauge() -> None:
    tracker = LoadTracker()
    with pytest.raises(AssertionError):
        tracker._adjust("w0", -1, 0)


@pytest.mark.parametrize(
    ("policy", "expected"), [("kv_aware", 25), ("cache_aware", 100), ("round_robin", 100)]
)
def test_only_an_exact_match_policy_leaves_predicted_cached_tokens_out(
    policy: str, expected: int
) -> None:
    query = RouteQuery(text="p" * 400, prefill_tokens=100)
    decision = RoutingDecision("w0", policy, "cache_hit", matched_fraction=0.75)
    assert guarded_prefill_tokens(query, decision) == expected
