"""kv_aware's replica salt: router replicas with the same index and loads choose alike
without it, split a tie by replica with it (the same split every time), keep a clear
win, and a lone router is untouched by it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.kv_aware import (
    SMALL_SALTED_FLEET,
    KvAwareChoice,
    KvAwareConfig,
    KvAwareRouting,
)
from kvserve.core.routing.tie_breaking import ReplicaSalt
from kvserve.core.routing.types import WorkerLoad

BLOCK = 16
# every decision salted (no burst window): these tests are of the salt itself
# the salt alone: no recompute or home weight
SPREAD = KvAwareConfig(
    replica_spread_s=0.02, replica_burst_window_s=0.0, recompute_weight=0.0, home_weight=0.0
)
REPLICAS = [f"r{i}" for i in range(8)]


def random_fleet(seed: int, size: int = 24) -> tuple[list[KVEvent | None], list[WorkerLoad]]:
    """Per worker: what it stored of a few prompt chains, and its guards."""
    rng = random.Random(seed)
    events: list[KVEvent | None] = []
    loads = []
    for i in range(size):
        chain = rng.randrange(3)
        depth = rng.randrange(0, 10)
        hashes = tuple(1000 * chain + b for b in range(1, depth + 1))
        events.append(KVEvent(1, "stored", "device", hashes, None) if hashes else None)
        requests = rng.randrange(0, 4)
        tokens = rng.randrange(0, 2000) if requests else 0
        loads.append(WorkerLoad(f"w{i}", requests, tokens))
    return events, loads


def routing_on(
    config: KvAwareConfig, events: list[KVEvent | None], loads: list[WorkerLoad]
) -> KvAwareRouting:
    routing = KvAwareRouting(config)
    for load, event in zip(loads, events, strict=True):
        routing.loads.update(load)
        if event is not None:
            routing.index.apply(load.worker_id, event)
    return routing


def route_requests(routing: KvAwareRouting, loads: list[WorkerLoad], seed: int) -> list[str]:
    """A stream of requests on ``loads``, each choice recorded (queued, speculated)."""
    rng = random.Random(seed)
    chosen = []
    for n in range(40):
        chain, depth = rng.randrange(4), rng.randrange(1, 12)
        hashes = [1000 * chain + b for b in range(1, depth + 1)]
        choice = routing.select(loads, hashes, depth * BLOCK + 5, BLOCK, now=n * 0.01)
        chosen.append(choice.worker_id)
    return chosen


@pytest.mark.parametrize("seed", range(6))
def test_without_spread_replicas_choose_as_each_other_and_as_one_router(seed: int) -> None:
    events, loads = random_fleet(seed)
    config = dataclasses.replace(SPREAD, replica_spread_s=0.0)
    one = route_requests(routing_on(config, events, loads), loads, seed)
    for name in ("r0", "r1"):
        replica = routing_on(config, events, loads)
        replica.as_replica(name, 0)
        assert replica.salt is None
        assert route_requests(replica, loads, seed) == one


@pytest.mark.parametrize("seed", range(6))
def test_a_lone_router_is_untouched_by_the_spread(seed: int) -> None:
    events, loads = random_fleet(seed)
    without = dataclasses.replace(SPREAD, replica_spread_s=0.0)
    assert route_requests(routing_on(SPREAD, events, loads), loads, seed) == route_requests(
        routing_on(without, events, loads), loads, seed
    )


@pytest.mark.parametrize("seed", range(6))
def test_replicas_fed_the_same_events_and_loads_choose_the_same_by_name(seed: int) -> None:
    events, loads = random_fleet(seed)
    runs = []
    for _ in range(2):
        replica = routing_on(SPREAD, events, loads)
        replica.as_replica("r3", 0)
        runs.append(route_requests(replica, loads, seed))
    assert runs[0] == runs[1]


def choose_on_idle_pair(name: str | None, config: KvAwareConfig) -> KvAwareChoice:
    routing = KvAwareRouting(config)
    if name is not None:
        routing.as_replica(name, 0)
    loads = [WorkerLoad("w0"), WorkerLoad("w1")]
    return routing.best(loads, [7, 8, 9], 3 * BLOCK, BLOCK, now=0.0)


def test_a_tie_splits_across_replicas_by_their_salt() -> None:
    chosen = {name: choose_on_idle_pair(name, SPREAD).worker_id for name in REPLICAS}
    for name, worker_id in chosen.items():
        salt = ReplicaSalt(name, SPREAD.replica_spread_s)
        assert worker_id == min(("w0", "w1"), key=salt)
    assert set(chosen.values()) == {"w0", "w1"}
    unsalted = dataclasses.replace(SPREAD, replica_spread_s=0.0)
    assert {choose_on_idle_pair(name, unsalted).worker_id for name in REPLICAS} == {
        choose_on_idle_pair(None, SPREAD).worker_id
    }


# a fleet predicted whole; one past SMALL_SALTED_FLEET, whose salted decisions predict
# only candidates
FLEET_SIZES = [6, SMALL_SALTED_FLEET + 12]


@pytest.mark.parametrize("size", FLEET_SIZES)
def test_a_win_by_more_than_the_spread_stands_on_every_replica(size: int) -> None:
    prompt = list(range(1, 41))  # 640 tokens: the holder saves far more than 20 ms
    for name in REPLICAS:
        routing = KvAwareRouting(SPREAD)
        routing.as_replica(name, 0)
        routing.index.apply("w1", KVEvent(1, "stored", "device", tuple(prompt), None))
        loads = [WorkerLoad(f"w{i}") for i in range(size)]
        choice = routing.best(loads, prompt, 40 * BLOCK + 3, BLOCK, now=0.0)
        assert (choice.worker_id, choice.reason) == ("w1", "cache_hit")


@pytest.mark.parametrize("size", FLEET_SIZES)
def test_a_replica_looks_past_the_single_lightest_for_its_salt(size: int) -> None:
    """Workers a few milliseconds apart in load are candidates of a salted decision, so
    replicas do not all take the one lightest: each takes its own near-lightest."""
    loads = [WorkerLoad(f"w{i}", 1, 40 * i) for i in range(size)]  # ~1 ms apart each
    chosen = set()
    for name in REPLICAS:
        routing = KvAwareRouting(SPREAD)
        routing.as_replica(name, 0)
        for load in loads:
            routing.loads.update(load)
        chosen.add(routing.best(loads, [5], BLOCK, BLOCK, now=0.0).worker_id)
    assert len(chosen) > 1


def test_salt_offsets_are_fixed_per_replica_and_worker_and_below_the_spread() -> None:
    a, again, b = ReplicaSalt("r0", 0.02), ReplicaSalt("r0", 0.02), ReplicaSalt("r1", 0.02)
    offsets = [a(f"w{i}") for i in range(50)]
    assert offsets == [again(f"w{i}") for i in range(50)]
    assert offsets != [b(f"w{i}") for i in range(50)]
    assert all(0 <= x < 0.02 for x in offsets)
    with pytest.raises(ValueError, match="replica_spread_s"):
        KvAwareConfig(replica_spread_s=-0.01)


def test_a_salted_decision_past_its_bound_predicts_candidates_not_the_fleet() -> None:
    """Walking the load orders for a salt's candidates costs more than predicting a small
    fleet whole, less past ``SMALL_SALTED_FLEET`` workers; the bound picks the path."""
    routing = KvAwareRouting(SPREAD)
    routing.as_replica("r0", 0)
    whole_fleets = []
    real_whole_fleet = routing._whole_fleet

    def counting_whole_fleet(*args: object) -> object:
        whole_fleets.append(len(args[0]))  # type: ignore[arg-type]
        return real_whole_fleet(*args)  # type: ignore[arg-type]

    routing._whole_fleet = counting_whole_fleet  # type: ignore[method-assign]
    for size in (SMALL_SALTED_FLEET, SMALL_SALTED_FLEET + 1):
        loads = [WorkerLoad(f"w{i}", 1, 40 * i) for i in range(size)]
        routing.best(loads, [5], BLOCK, BLOCK, now=0.0)
    assert whole_fleets == [SMALL_SALTED_FLEET]
