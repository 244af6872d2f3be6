"""``benchmarks/routing_scale.py``'s fleet is what its figures claim to measure: each
request extends a conversation its owner holds from the first block (block hashes are
chained, so no worker holds a conversation without the system prompt it starts with),
and a run times every rule on every decision."""

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


def test_a_run_times_every_rule_on_every_decision(routing_scale: ModuleType) -> None:
    times = routing_scale.decision_times(30, 16, 100, 12, seed=0)
    assert sorted(times) == ["cache_aware", "kv_aware", "kv_aware exhaustive"]
    assert all(len(t) == 12 and min(t) > 0 for t in times.values())
