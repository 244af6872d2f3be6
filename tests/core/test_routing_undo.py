"""``Policy.undo``: a decision whose attempt failed before its first token takes back what
the policy recorded for it, and nothing else (per policy, and per pair rule)."""

from __future__ import annotations

import pytest

from kvserve.core.routing.approximate_tree import ApproximatePrefixTree
from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.routing.policies import POLICY_NAMES, make_policy
from kvserve.core.routing.policies.cache_aware import CacheAwarePolicy
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.types import PromptBlocks, RouteQuery, WorkerLoad

BLOCK = 16
HASHES = list(range(1, 41))  # 40 full blocks
PD = PDConfig(min_remote_prefill_tokens=64, local_hit_fraction=0.8)
FLEET = [WorkerLoad("w0"), WorkerLoad("w1")]


def kv_query(hashes: list[int] = HASHES) -> RouteQuery:
    tokens = len(hashes) * BLOCK + 5
    return RouteQuery("x", prefill_tokens=tokens, blocks=PromptBlocks(tokens, hashes, BLOCK))


def kv_policy() -> KvAwarePolicy:
    policy = make_policy("kv_aware", 0.0)
    assert isinstance(policy, KvAwarePolicy)
    return policy


def test_kv_aware_undo_withdraws_speculation_and_the_queued_prefill() -> None:
    policy = kv_policy()
    first = policy.select(kv_query(), FLEET, 0.0)
    routing = policy.routing
    assert routing.index.num_speculative(first.worker_id) == len(HASHES)
    assert routing.queue.queued_s(first.worker_id, 0.0) > 0
    policy.undo(first, 0.001)
    assert routing.index.num_speculative(first.worker_id) == 0
    assert routing.queue.queued_s(first.worker_id, 0.001) == pytest.approx(0, abs=1e-12)
    assert policy.select(kv_query(), FLEET, 0.002).reason == "cache_miss"


def test_kv_aware_undo_keeps_what_later_decisions_recorded() -> None:
    policy = kv_policy()
    routing = policy.routing
    first = policy.select(kv_query(), FLEET, 0.0)
    second = policy.select(kv_query(), FLEET, 0.001)  # follows the speculation
    assert second.worker_id == first.worker_id and second.reason == "cache_hit"
    queued = routing.queue.queued_s(first.worker_id, 0.001)
    first_left = routing.config.prefill_s(len(HASHES) * BLOCK + 5) - 0.001
    second_s = queued - first_left
    policy.undo(first, 0.001)
    # The second one renewed every block's speculation: it stands, and so does its prefill.
    assert routing.index.num_speculative(first.worker_id) == len(HASHES)
    assert routing.queue.queued_s(first.worker_id, 0.001) == pytest.approx(second_s)
    assert second_s > 0


def test_kv_aware_undo_of_a_prefill_predicted_done_takes_back_nothing_more() -> None:
    policy = kv_policy()
    first = policy.select(kv_query(), FLEET, 0.0)
    second = policy.select(kv_query(), FLEET, 0.5)  # the first's prefill predicted done
    queued = policy.routing.queue.queued_s(second.worker_id, 0.5)
    policy.undo(first, 0.5)
    assert policy.routing.queue.queued_s(second.worker_id, 0.5) == pytest.approx(queued)


def test_kv_aware_pair_undo_clears_both_workers() -> None:
    policy = kv_policy()
    decodes, prefills = [WorkerLoad("d0"), WorkerLoad("d1")], [WorkerLoad("p0")]
    pair = policy.select_pair(kv_query(), decodes, prefills, 0.0, PD)
    assert pair.reason == "remote" and pair.prefill_worker_id == "p0"
    index = policy.routing.index
    assert index.num_speculative("p0") == index.num_speculative(pair.worker_id) == len(HASHES)
    policy.undo(pair, 0.0)
    assert index.num_speculative("p0") == index.num_speculative(pair.worker_id) == 0
    assert policy.routing.queue.queued_s("p0", 0.0) == pytest.approx(0, abs=1e-12)


TEXT = "a long shared system prompt about the sea, then the first question"


def test_cache_aware_undo_forgets_the_prompt_where_it_was_never_computed() -> None:
    policy = make_policy("cache_aware", 0.0)
    assert isinstance(policy, CacheAwarePolicy)
    first = policy.select(RouteQuery(TEXT), FLEET, 0.0)
    policy.undo(first, 0.0)
    assert policy.select(RouteQuery(TEXT), FLEET, 1.0).reason == "cache_miss"


def test_cache_aware_undo_keeps_what_the_worker_held_before() -> None:
    policy = make_policy("cache_aware", 0.0)
    assert isinstance(policy, CacheAwarePolicy)
    first = policy.select(RouteQuery(TEXT), FLEET, 0.0)
    longer = TEXT + " and a second question that failed"
    second = policy.select(RouteQuery(longer), FLEET, 1.0)
    assert second.worker_id == first.worker_id and second.reason == "cache_hit"
    policy.undo(second, 1.0)
    tree = policy.index.tree("regular", "")
    assert tree.match(longer) == {first.worker_id: len(TEXT)}


def test_cache_aware_pair_undo_clears_both_trees() -> None:
    policy = make_policy("cache_aware", 0.0)
    assert isinstance(policy, CacheAwarePolicy)
    query = RouteQuery(TEXT * 4, prefill_tokens=400)
    pair = policy.select_pair(query, [WorkerLoad("d0")], [WorkerLoad("p0")], 0.0, PD)
    assert pair.prefill_worker_id == "p0"
    policy.undo(pair, 0.0)
    for pool in ("decode", "prefill"):
        assert policy.index.tree(pool, "").match(query.text) == {}


@pytest.mark.parametrize("name", sorted(set(POLICY_NAMES) - {"kv_aware", "cache_aware"}))
def test_stateless_policies_record_nothing_to_undo(name: str) -> None:
    policy = make_policy(name, 0.0, seed=1)
    decision = policy.select(RouteQuery(TEXT, session_key="s"), FLEET, 0.0)
    pair = policy.select_pair(RouteQuery(TEXT, prefill_tokens=400), FLEET, FLEET, 0.0, PD)
    assert decision.take_back is None and pair.take_back is None
    policy.undo(decision, 0.0)  # nothing to do, and no error


def test_untag_keeps_a_prefix_held_and_branches_that_share_it() -> None:
    tree = ApproximatePrefixTree()
    tree.insert("shared prefix / branch one", "w0", 0.0)
    tree.insert("shared prefix / branch two", "w0", 1.0)
    tree.insert("shared prefix / branch two", "w1", 1.0)
    tree.untag("shared prefix / branch two", "w0", keep_chars=len("shared prefix / branch "))
    assert tree.match("shared prefix / branch two") == {"w0": 23, "w1": 26}
    assert tree.match("shared prefix / branch one") == {"w0": 26, "w1": 23}
    tree.untag("shared prefix / branch two", "w1", keep_chars=0)
    assert tree.match("shared prefix / branch two") == {"w0": 23}
    tree.untag("shared prefix / branch one", "w0", keep_chars=0)
    assert tree.match("shared prefix / branch one") == {}
    assert tree.size_chars == 0
