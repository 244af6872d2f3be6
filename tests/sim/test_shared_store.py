"""A KV store the simulated fleet shares: written through, loaded before admission, its
load timed, its blocks announced as a worker's storage events and credited by kv_aware to
every worker, as the router credits a real store."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.core.hashing import make_namespace
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.sim.shared_store import SimStore, StoreLoads
from kvserve.sim.simulator import MODEL, SimConfig, Simulation
from kvserve.sim.trace import BLOCK_TOKENS, TraceRequest
from tests.sim.test_simulator import config

PROMPT = tuple(range(1, 18))  # 16 full blocks and a partial one
LOAD_TOKEN_S = 1e-5


def request(spec: TraceRequest) -> Request:
    return Request(
        spec.request_id,
        spec.prompt_token_ids(),
        SamplingParams(max_tokens=spec.output_tokens),
        max_tokens=spec.output_tokens,
        namespace=make_namespace(MODEL),
        block_size=BLOCK_TOKENS,
    )


def twice(gap_s: float = 5.0) -> list[TraceRequest]:
    tokens = 16 * BLOCK_TOKENS + 100
    return [
        TraceRequest("t1", 0.0, tokens, 4, PROMPT),
        TraceRequest("t2", gap_s, tokens, 4, PROMPT),
    ]


def with_store(base: SimConfig, blocks: int) -> SimConfig:
    return dataclasses.replace(
        base, store_tokens=blocks * BLOCK_TOKENS, store_load_token_s=LOAD_TOKEN_S
    )


def test_the_store_forgets_the_least_recently_used_and_counts_runs() -> None:
    store = SimStore(3, LOAD_TOKEN_S)
    assert store.write([1, 2, 3]) == []
    assert store.run([1, 2, 9], 0) == 2  # 1 and 2 read: now the newest
    assert store.write([4]) == [3]
    assert store.run([1, 2, 3], 0) == 2
    assert store.run([7, 2, 4], 1) == 2


def test_a_request_waits_for_its_load_then_is_admitted_on_the_installed_blocks() -> None:
    cache = KVCacheManager(32, BLOCK_TOKENS)
    store = SimStore(64, LOAD_TOKEN_S)
    loads = StoreLoads(store, cache)
    scheduler = Scheduler(cache, SchedulerConfig(max_num_batched_tokens=16 * BLOCK_TOKENS), loads)
    first, other = request(twice()[0]), request(TraceRequest("o", 0.0, 100, 4, (99,)))
    store.write(first.reusable_block_hashes()[:10])
    scheduler.add(first)
    scheduler.add(other)
    plan = scheduler.schedule()  # the first waits for its load; the other goes
    assert [c.request.request_id for c in plan.chunks] == ["o"]
    load_s = 10 * BLOCK_TOKENS * LOAD_TOKEN_S
    assert loads.next_ready() == pytest.approx(load_s)
    scheduler.advance(plan)
    loads.now = load_s
    plan = scheduler.schedule()
    loads.release_admitted()
    assert "t1" in {c.request.request_id for c in plan.chunks}
    assert first.num_cached_tokens == 10 * BLOCK_TOKENS
    assert store.loaded_tokens == 10 * BLOCK_TOKENS and loads.next_ready() is None
    cache.check()
    scheduler.advance(plan)
    for done in (first, other):
        scheduler.finish(done, "stop")
    assert cache.num_available_blocks == cache.num_blocks  # no install left pinned


def test_a_loaded_request_without_room_keeps_its_load_and_its_place() -> None:
    """Its install finds no room beside a running request: it starts no second load
    (which would let later requests overtake it again) and installs once room is freed."""
    cache = KVCacheManager(20, BLOCK_TOKENS)
    store = SimStore(64, LOAD_TOKEN_S)
    loads = StoreLoads(store, cache)
    scheduler = Scheduler(cache, SchedulerConfig(max_num_batched_tokens=16 * BLOCK_TOKENS), loads)
    big = request(TraceRequest("big", 0.0, 15 * BLOCK_TOKENS, 4, tuple(range(200, 215))))
    first = request(twice()[0])
    store.write(first.reusable_block_hashes()[:10])
    scheduler.add(big)
    scheduler.advance(scheduler.schedule())
    scheduler.add(first)
    scheduler.advance(scheduler.schedule())
    loads.now = 1.0  # its load is done
    scheduler.advance(scheduler.schedule())
    assert first.num_cached_tokens is None and loads.next_ready() is None
    assert store.loaded_tokens == 0
    scheduler.finish(big, "stop")
    plan = scheduler.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["t1"]
    assert first.num_cached_tokens == 10 * BLOCK_TOKENS
    cache.check()


def test_loads_of_one_worker_run_one_after_another() -> None:
    cache = KVCacheManager(64, BLOCK_TOKENS)
    store = SimStore(64, LOAD_TOKEN_S)
    loads = StoreLoads(store, cache)
    specs = [
        TraceRequest(
            f"r{i}", 0.0, 4 * BLOCK_TOKENS, 4, (10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4)
        )
        for i in range(2)
    ]
    requests = [request(spec) for spec in specs]
    for r in requests:
        store.write(r.reusable_block_hashes())
    assert not any(loads.may_admit(r) for r in requests)
    one = 3 * BLOCK_TOKENS * LOAD_TOKEN_S  # the last block is not a full one
    assert loads.next_ready() == pytest.approx(one)
    loads.now = one
    assert loads.may_admit(requests[0]) and not loads.may_admit(requests[1])
    assert loads.next_ready() == pytest.approx(2 * one)


def test_a_worker_loads_what_another_computed_and_its_first_token_comes_sooner() -> None:
    base = config(workers=2)
    cold = Simulation("round_robin", base).run(twice())
    shared = Simulation("round_robin", with_store(base, 64)).run(twice())
    by_id = {r.worker_id: r for r in shared.records}
    assert set(by_id) == {"w0", "w1"}  # the second request went to the other worker
    second = max(shared.records, key=lambda r: r.arrival_s)
    assert second.cached_tokens == 16 * BLOCK_TOKENS
    assert shared.store_loaded_tokens == 16 * BLOCK_TOKENS and cold.store_loaded_tokens is None
    [cold_second] = [r for r in cold.records if r.arrival_s == second.arrival_s]
    assert cold_second.cached_tokens == 0
    assert second.first_token_s is not None and cold_second.first_token_s is not None
    assert second.first_token_s < cold_second.first_token_s
    load_s = 16 * BLOCK_TOKENS * LOAD_TOKEN_S
    assert second.first_token_s - second.arrival_s > load_s


def test_kv_aware_credits_a_stored_block_to_every_worker() -> None:
    sim = Simulation("kv_aware", with_store(config(workers=3), 64))
    sim.run(twice()[:1])
    hashes = request(twice()[0]).reusable_block_hashes()
    index = sim.replicas[0].policy.routing.index  # type: ignore[attr-defined]
    matches = index.match(hashes, ["w0", "w1", "w2"], now=10.0)
    writer = next(w for w, m in matches.items() if m.blocks_by_tier["device"])
    assert matches[writer].blocks_by_tier["device"] == 16
    for worker_id in {"w0", "w1", "w2"} - {writer}:
        assert matches[worker_id].blocks_by_tier == {"device": 0, "host": 0, "storage": 16}
    index.check()


def test_what_the_store_evicts_is_withdrawn_from_every_worker() -> None:
    """A store of 8 blocks keeps the prompt's last 8: no prefix of it is loadable."""
    sim = Simulation("kv_aware", with_store(config(workers=2), 8))
    sim.run(twice()[:1])
    hashes = request(twice()[0]).reusable_block_hashes()
    index = sim.replicas[0].policy.routing.index  # type: ignore[attr-defined]
    matches = index.match(hashes, ["w0", "w1"], now=10.0)
    assert sorted(m.blocks_by_tier["storage"] for m in matches.values()) == [0, 0]
    assert sum(index.num_blocks(w, "storage") for w in ("w0", "w1")) == 8
    index.check()


def test_a_store_is_refused_for_pd_fleets_and_smaller_than_a_block() -> None:
    with pytest.raises(ValueError, match="mixed fleets"):
        dataclasses.replace(config(workers=2), prefill_workers=1, store_tokens=10 * BLOCK_TOKENS)
    with pytest.raises(ValueError, match="one"):
        dataclasses.replace(config(workers=2), store_tokens=BLOCK_TOKENS - 1)


def test_an_arrival_runs_at_once_on_a_worker_idle_but_for_a_load() -> None:
    """One worker, whose cache the second prompt evicts the first from: the first again
    loads from the store, and a short request arriving meanwhile runs before that load
    ends (the worker's wait for it is cut short), then the load's request runs."""
    other = tuple(range(100, 118))
    tokens = 16 * BLOCK_TOKENS + 100
    trace = [
        TraceRequest("first", 0.0, tokens, 2, PROMPT),
        TraceRequest("evicts", 5.0, tokens, 2, other),
        TraceRequest("again", 10.0, tokens, 2, PROMPT),
        TraceRequest("short", 10.01, 100, 2, (999,)),
    ]
    result = Simulation("round_robin", with_store(config(workers=1, cache_blocks=20), 64)).run(
        trace
    )
    by_id = {r.arrival_s: r for r in result.records}
    again, short = by_id[10.0], by_id[10.01]
    assert again.cached_tokens == 16 * BLOCK_TOKENS  # on device still, or loaded
    assert result.store_loaded_tokens
    load_s = result.store_loaded_tokens * LOAD_TOKEN_S
    assert short.first_token_s is not None and again.first_token_s is not None
    assert short.first_token_s < 10.0 + load_s < again.first_token_s
    assert result.unfinished == 0
