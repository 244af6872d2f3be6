"""``benchmarks/routing_scale.py``'s fleet is what its figures claim to measure: each
request extends a conversation its owner holds from the first block (block hashes are
chained, so no worker holds a conversation without the system prompt it starts with),
and a run times every rule on every decision, each rule in its own pass on the same
states."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "routing_scale.py"


@pytest.fixture(scope="module")
def routing_scale() -> ModuleType:
    spec = importlib.util.spec_from_file_location("routing_scale", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("workers", [10, 50])
def test_each_request_is_held_by_its_owner_but_for_its_two_new_blocks(
    routing_scale: ModuleType, workers: int
) -> None:
    fleet = routing_scale.Fleet(workers, 100, 16, seed=0)
    policy = KvAwarePolicy(KvAwareConfig())
    fleet.fill(policy)
    owner_of = {h: w for w, chains in fleet.conversations.items() for c in chains for h in c[-3:]}
    with_system = 0
    for _ in range(40):
        hashes = fleet.query().blocks.reusable_hashes
        assert len(hashes) == 16
        owner = owner_of[hashes[-3]]
        match = policy.routing.index.match(hashes, [owner], now=0.0)[owner]
        assert match.num_blocks == 14
        with_system += hashes[: routing_scale.SYSTEM_BLOCKS] == routing_scale.SYSTEM
    assert 0 < with_system < 40 if workers > 10 else with_system == 40


def test_a_run_times_every_rule_on_every_decision_after_the_warmup(
    routing_scale: ModuleType,
) -> None:
    other_work = routing_scale.OtherWork(0.5)
    times = routing_scale.decision_times(30, 16, 100, 12, seed=0, warmup=20, other_work=other_work)
    assert sorted(times) == ["cache_aware", "kv_aware", "kv_aware exhaustive"]
    assert all(len(t) == 12 and min(t) > 0 for t in times.values())


def test_every_pass_decides_on_the_states_of_kv_awares_own(routing_scale: ModuleType) -> None:
    """The cache_aware pass replays kv_aware's choices; the exhaustive pass makes them
    again from a fleet of its own and stops if one differs: the passes see the same
    loads only if the fleet and its queries repeat from the seed."""
    choices: list[str] = []
    none = routing_scale.OtherWork(0)
    first = routing_scale.Fleet(40, 100, 16, seed=3)
    routing_scale._pass("kv_aware", first, 30, 5, 0, choices, none)
    assert len(choices) == 35 and len(set(choices)) > 5
    again = routing_scale.Fleet(40, 100, 16, seed=3)
    assert len(routing_scale._pass("kv_aware exhaustive", again, 30, 5, 0, choices, none)) == 30
    other = routing_scale.Fleet(40, 100, 16, seed=4)
    with pytest.raises(AssertionError, match="left kv_aware's decisions"):
        routing_scale._pass("kv_aware exhaustive", other, 30, 5, 0, choices, none)


def test_with_a_shared_store_every_worker_holds_each_request_through_it(
    routing_scale: ModuleType,
) -> None:
    """Every worker loads from one store its conversations were written to: a request's
    owner holds it on device, every other worker through the store, and the fast rule's
    choices stay the exhaustive one's over a run (its pass asserts so)."""
    fleet = routing_scale.Fleet(30, 100, 16, seed=0)
    policy = KvAwarePolicy(KvAwareConfig())
    fleet.fill(policy, shared_store=True)
    hashes = fleet.query().blocks.reusable_hashes
    matches = policy.routing.index.match(hashes, fleet.ids, now=0.0)
    assert sorted(m.num_blocks for m in matches.values()) == [14] * 30
    owners = [w for w, m in matches.items() if m.blocks_by_tier["device"] == 14]
    assert len(owners) == 1  # the others hold on device the system prompt at most
    assert all(m.blocks_by_tier["storage"] >= 14 - 8 for w, m in matches.items() if w not in owners)
    times = routing_scale.decision_times(30, 16, 100, 12, seed=0, warmup=20, shared_store=True)
    assert all(len(t) == 12 for t in times.values())
