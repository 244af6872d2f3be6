"""Policies as pure objects: the same calls the router and the simulator make."""

from __future__ import annotations

import pytest

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.routing.policies import POLICY_NAMES, make_policy
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.types import PromptBlocks, RouteQuery, WorkerLoad

PD = PDConfig(min_remote_prefill_tokens=64, local_hit_fraction=0.8)


def _policy(name: str) -> Policy:
    return make_policy(name, 0.0, seed=1)


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


def test_an_unknown_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("psychic", 0.0)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_selects_a_pair_from_the_right_pools(name: str) -> None:
    policy = _policy(name)
    decodes = [WorkerLoad("d0"), WorkerLoad("d1", kv_free_fraction=0.0)]
    prefills = [WorkerLoad("p0"), WorkerLoad("p1")]
    for i in "abcd":  # distinct prompts: nothing cached on the decode pool yet
        long_prompt = RouteQuery(i + "x" * 4000, session_key="k", prefill_tokens=1000)
        pair = policy.select_pair(long_prompt, decodes, prefills, 0.0, PD)
        assert (pair.policy, pair.worker_id, pair.reason) == (name, "d0", "remote")
        assert pair.prefill_worker_id in {"p0", "p1"}
        assert pair.header_value().startswith(f"policy={name}; reason=remote")
    short = policy.select_pair(RouteQuery("x", prefill_tokens=10), decodes, prefills, 1.0, PD)
    assert (short.reason, short.prefill_worker_id) == ("local_short", None)
    assert short.header_value().endswith("prefill=local")
    alone = policy.select_pair(RouteQuery("e" * 4000, prefill_tokens=1000), decodes, [], 2.0, PD)
    assert (alone.reason, alone.prefill_worker_id) == ("no_prefill_worker", None)


def test_round_robin_pairs_rotate_each_pool_on_its_own() -> None:
    policy = _policy("round_robin")
    decodes = [WorkerLoad("d0"), WorkerLoad("d1")]
    query = RouteQuery("x" * 4000, prefill_tokens=1000)
    pairs = [policy.select_pair(query, decodes, [WorkerLoad("p0")], 0.0, PD) for _ in range(4)]
    assert all(p.prefill_worker_id == "p0" for p in pairs)
    assert [p.worker_id for p in pairs] == ["d0", "d1", "d0", "d1"]


def test_kv_aware_pairs_from_both_pools_events() -> None:
    """The prefill worker holding the prompt gets its prefill; a decode worker holding
    most of it prefills locally."""
    block = 16
    hashes = list(range(100, 140))
    query = RouteQuery("", prefill_tokens=1, blocks=PromptBlocks(40 * block + 3, hashes, block))
    decodes, prefills = [WorkerLoad("d0"), WorkerLoad("d1")], [WorkerLoad("p0"), WorkerLoad("p1")]
    policy = _policy("kv_aware")
    policy.observe_events("p1", [KVEvent(1, "stored", "device", tuple(hashes[:30]), None)])
    pair = policy.select_pair(query, decodes, prefills, 0.0, PD)
    assert (pair.reason, pair.prefill_worker_id) == ("remote", "p1")
    assert pair.matched_fraction == pytest.approx(30 * block / (40 * block + 3))

    policy = _policy("kv_aware")
    policy.observe_snapshot("d1", "device", hashes[:36])  # 576 of 643 tokens
    pair = policy.select_pair(query, decodes, prefills, 0.0, PD)
    assert (pair.worker_id, pair.reason, pair.prefill_worker_id) == ("d1", "local_cached", None)
