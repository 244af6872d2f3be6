"""A pool's loads kept between decisions: a read-only sequence with a by-id view, and
kv_aware choosing from it exactly as from a list made per decision."""

from __future__ import annotations

import random

import pytest

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.kv_aware import SMALL_FLEET, KvAwareConfig, KvAwareRouting
from kvserve.core.routing.pool_loads import PoolLoads, guarded_prefill_tokens, loads_by_id
from kvserve.core.routing.types import WorkerLoad

BLOCK = 16


def test_a_pool_reads_as_its_list_and_by_id() -> None:
    loads = [WorkerLoad("w0", 1, 10), WorkerLoad("w1"), WorkerLoad("w2", 2, 0)]
    pool = PoolLoads(loads)
    assert list(pool) == loads and len(pool) == 3
    assert pool[1] is loads[1] and pool[-1] is loads[2] and pool[:2] == loads[:2]
    assert dict(pool.by_id) == {load.worker_id: load for load in loads}
    assert loads_by_id(pool) is pool.by_id
    assert loads_by_id(loads) == pool.by_id


def test_replacing_a_load_changes_both_views_and_ignores_workers_outside_the_pool() -> None:
    pool = PoolLoads([WorkerLoad("w0"), WorkerLoad("w1")])
    busier = WorkerLoad("w1", 3, 300)
    pool.replace(busier)
    pool.replace(WorkerLoad("w9", 1, 1))
    assert pool[1] is busier and pool.by_id["w1"] is busier
    assert [load.worker_id for load in pool] == ["w0", "w1"] and "w9" not in pool.by_id


def test_a_pool_keeps_the_guarded_prefill_tokens_of_its_workers_in_all() -> None:
    """Its own guards' and its peers' reported tokens, kept as loads are replaced, the
    same sum a list's loads give."""
    pool = PoolLoads([WorkerLoad("w0", 1, 10), WorkerLoad("w1", 0, 0, 1.0, 5)])
    assert pool.prefill_tokens == guarded_prefill_tokens(list(pool)) == 15
    pool.replace(WorkerLoad("w1", 2, 300, 1.0, 7))
    pool.replace(WorkerLoad("w0"))
    pool.replace(WorkerLoad("w9", 1, 1000))  # outside the pool: not counted
    assert pool.prefill_tokens == guarded_prefill_tokens(list(pool)) == 307
    assert guarded_prefill_tokens(pool) == 307


def test_a_pool_lists_each_worker_once() -> None:
    with pytest.raises(ValueError, match="once"):
        PoolLoads([WorkerLoad("w0"), WorkerLoad("w0", 1, 1)])


def fleet(workers: int) -> tuple[KvAwareRouting, list[int]]:
    """A fleet past the size predicted whole: a tenth hold a shared prefix, each worker
    a conversation of its own."""
    routing = KvAwareRouting(KvAwareConfig())
    shared = list(range(1, 9))
    for n in range(workers):
        own = list(range(1000 + 10 * n, 1000 + 10 * n + 6))
        held = (shared if n % 10 == 0 else []) + own
        routing.observe_events(f"w{n}", [KVEvent(1, "stored", "device", tuple(held), None)])
    return routing, shared


def test_kv_aware_chooses_from_a_kept_pool_as_from_a_list_made_per_decision() -> None:
    workers = SMALL_FLEET + 72  # the candidates path, where the by-id view is read
    from_lists, shared = fleet(workers)
    from_pool, _ = fleet(workers)
    loads = {f"w{n}": WorkerLoad(f"w{n}") for n in range(workers)}
    pool = PoolLoads(loads.values())
    rng = random.Random(7)
    for n in range(300):
        now = n * 0.01
        owner = rng.randrange(workers)
        own = list(range(1000 + 10 * owner, 1000 + 10 * owner + rng.randrange(7)))
        prompt = [*shared, *own] if rng.random() < 0.5 else own
        if not prompt:
            prompt = [10**6 + n]
        tokens = len(prompt) * BLOCK + 3
        listed = from_lists.select(list(loads.values()), prompt, tokens, BLOCK, now)
        kept = from_pool.select(pool, prompt, tokens, BLOCK, now)
        assert kept.worker_id == listed.worker_id, n
        assert kept.prediction.ttft_s == listed.prediction.ttft_s
        for worker_id, change in ((kept.worker_id, 1), (f"w{rng.randrange(workers)}", -1)):
            old = loads[worker_id]
            if old.in_flight_requests + change < 0:
                continue
            load = WorkerLoad(
                worker_id,
                old.in_flight_requests + change,
                max(0, old.in_flight_prefill_tokens + change * tokens),
            )
            loads[worker_id] = load
            pool.replace(load)
            from_lists.loads.update(load)
            from_pool.loads.update(load)


def test_a_worker_forgotten_and_back_in_a_kept_pool_is_a_candidate_again() -> None:
    workers = SMALL_FLEET + 72
    routing, _ = fleet(workers)
    busy = [WorkerLoad(f"w{n}", 5, 5000) for n in range(workers)]
    pool = PoolLoads([*busy[:5], WorkerLoad("w5"), *busy[6:]])
    cold = [10**7, 10**7 + 1]  # held by no one: the lightest worker wins
    assert routing.best(pool, cold, 40, BLOCK, 0.0).worker_id == "w5"
    routing.forget_worker("w5")  # its stream restarted, say; the router still lists it
    assert routing.best(pool, cold, 40, BLOCK, 0.1).worker_id == "w5"
