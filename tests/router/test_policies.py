"""Policies as pure objects: the same calls the simulator makes."""

from __future__ import annotations

from kvserve.core.routing.types import RouteQuery, WorkerLoad
from kvserve.router.config import RouterConfig
from kvserve.router.policies import make_policy


def _policy(name: str):
    return make_policy(RouterConfig(policy=name, seed=1), now=0.0)


def test_power_of_two_always_takes_the_lighter_of_its_pair() -> None:
    fleet = [WorkerLoad("w0", 9), WorkerLoad("w1", 0)]
    policy = _policy("power_of_two")
    assert {policy.select(RouteQuery("x"), fleet, 0.0).worker_id for _ in range(20)} == {"w1"}
    assert policy.select(RouteQuery("x"), fleet[:1], 0.0).reason == "only_worker"


def test_cache_aware_forgets_a_removed_worker() -> None:
    policy = _policy("cache_aware")
    fleet = [WorkerLoad("w0"), WorkerLoad("w1")]
    prompt = RouteQuery("a long shared system prompt, then a question")
    first = policy.select(prompt, fleet, 0.0).worker_id
    assert policy.select(prompt, fleet, 1.0).worker_id == first
    policy.forget_worker(first)
    assert policy.select(prompt, fleet, 2.0).reason == "cache_miss"


def test_session_keys_map_consistently() -> None:
    policy = _policy("session")
    fleet = [WorkerLoad(f"w{i}") for i in range(3)]
    picks = {
        policy.select(RouteQuery("x", session_key="k"), fleet, 0.0).worker_id for _ in range(5)
    }
    assert len(picks) == 1
