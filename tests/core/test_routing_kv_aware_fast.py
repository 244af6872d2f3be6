"""kv_aware's fast decision (holders from one index walk, the lightest loads from an
ordered structure) against the reference rule that predicts every worker, on generated
fleets: the same smallest prediction always, the same worker unless equal predictions
and loads leave a tie."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing import kv_index
from kvserve.core.routing.kv_aware import (
    SMALL_FLEET,
    KvAwareConfig,
    KvAwareRouting,
    _choose,
    _choose_whole,
    _choose_whole_weighted,
    _deepest_holders,
    _ttft,
    _WholeFleet,
    lowest_ttft,
    predict,
)
from kvserve.core.routing.kv_index import TIERS
from kvserve.core.routing.types import WorkerLoad

BLOCK = 16
CONFIG = KvAwareConfig(
    prefill_token_s=1e-4,
    attention_pair_s=1e-8,
    host_load_token_s=5e-5,
    storage_load_token_s=2e-4,  # slower than computing: a storage hit can lose to a miss
    decode_request_s=1e-3,
    speculative_ttl_s=1.0,
    recompute_weight=3.0,  # a worker outside the candidates still cannot score lower
    home_weight=0.0,
    home_slack_queue_s=float("inf"),  # the weights apply to every decision
    recompute_slack_queue_s=float("inf"),
)
# no weight: a whole small fleet's choice is then made from its groups (_choose_whole)
UNWEIGHTED = dataclasses.replace(CONFIG, recompute_weight=0.0)
HOME = dataclasses.replace(CONFIG, home_weight=3.0)  # the home term, the weight scaled
CONFIGS = pytest.mark.parametrize(
    "config", [CONFIG, UNWEIGHTED, HOME], ids=["weighted", "unweighted", "home"]
)
PROMPT = list(range(1, 13))  # a 12-block chain; workers hold prefixes of it, or of others

held = st.tuples(
    st.integers(0, 12),  # how many of the prompt's first blocks
    st.sampled_from(TIERS),
    st.booleans(),  # or a chain that diverges after one block
)
worker = st.tuples(
    st.integers(0, 4),  # in-flight requests
    st.integers(0, 3000),  # guarded prefill tokens
    st.lists(held, max_size=2),
    st.one_of(st.none(), st.floats(0.0, 0.5)),  # a queued prefill pushed at time 0
    st.integers(0, 12),  # speculative blocks of the prompt
    st.sampled_from([0, 0, 800]),  # prefill tokens other router replicas reported
)


def build(
    fleet: list[tuple[int, int, list[tuple[int, str, bool]], float | None, int, int]],
    small_fleet: int = 0,
    config: KvAwareConfig = CONFIG,
    stores: list[str | None] | None = None,
    join_first: bool = False,
) -> tuple[KvAwareRouting, list[WorkerLoad]]:
    """A routing over ``fleet``; fleets up to ``small_fleet`` workers predicted whole
    (0: the fast rule at every size, the one these tests check); worker ``i`` loading
    from the shared store ``stores[i]``, told before its events (``join_first``) or
    after them."""
    routing = KvAwareRouting(config)
    routing.small_fleet = small_fleet
    loads = []
    for i, (requests, tokens, holdings, queued, speculative, others) in enumerate(fleet):
        worker_id = f"w{i}"
        load = WorkerLoad(worker_id, requests, tokens if requests else 0, 1.0, others)
        loads.append(load)
        routing.loads.update(load)
        store = stores[i] if stores else None
        if join_first:
            routing.index.set_store(worker_id, store)
        for seq, (count, tier, diverges) in enumerate(holdings, start=1):
            hashes = [PROMPT[0], 100 + i] if diverges else PROMPT[:count]
            routing.index.apply(worker_id, KVEvent(seq, "stored", tier, tuple(hashes), None))
        routing.index.set_store(worker_id, store)
        if queued is not None:
            routing.queue.push(worker_id, queued, now=0.0)
        routing.index.speculate(worker_id, PROMPT[:speculative], deadline=0.5)
    return routing, loads


@pytest.mark.parametrize("small_fleet", [0, SMALL_FLEET])  # the fast rule; a whole small fleet
@pytest.mark.parametrize("run_blocks", [0, kv_index.RUN_BLOCKS])  # 0: each worker walked alone
@CONFIGS
@settings(max_examples=400, deadline=None)
@given(
    fleet=st.lists(worker, min_size=1, max_size=12),
    prompt_blocks=st.integers(0, 12),
    now=st.floats(0.0, 0.8),
    eligible_mask=st.integers(1, 2**12 - 1),
)
def test_fast_rule_equals_the_exhaustive_one(
    small_fleet: int,
    run_blocks: int,
    config: KvAwareConfig,
    fleet: list[tuple[int, int, list[tuple[int, str, bool]], float | None, int, int]],
    prompt_blocks: int,
    now: float,
    eligible_mask: int,
) -> None:
    routing, loads = build(fleet, small_fleet, config)
    assert_fast_equals_exhaustive_for(routing, loads, eligible_mask, prompt_blocks, now, run_blocks)


def assert_fast_equals_exhaustive_for(
    routing: KvAwareRouting,
    loads: list[WorkerLoad],
    eligible_mask: int,
    prompt_blocks: int,
    now: float,
    run_blocks: int,
) -> None:
    """:func:`assert_fast_equals_exhaustive` on the workers of ``eligible_mask`` (the
    first one if none), the walk switching to each worker alone at ``run_blocks``."""
    workers = [w for i, w in enumerate(loads) if eligible_mask >> i & 1] or loads[:1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_index, "RUN_BLOCKS", run_blocks)
        assert_fast_equals_exhaustive(routing, workers, PROMPT[:prompt_blocks], now)


@pytest.mark.parametrize("small_fleet", [0, SMALL_FLEET])
@pytest.mark.parametrize("run_blocks", [0, kv_index.RUN_BLOCKS])
@pytest.mark.parametrize("join_first", [False, True])
@CONFIGS
@settings(max_examples=200, deadline=None)
@given(
    fleet=st.lists(worker, min_size=1, max_size=12),
    stores=st.lists(st.sampled_from([None, "s", "s", "t"]), min_size=12, max_size=12),
    prompt_blocks=st.integers(0, 12),
    now=st.floats(0.0, 0.8),
    eligible_mask=st.integers(1, 2**12 - 1),
)
def test_fast_rule_equals_the_exhaustive_one_with_shared_stores(
    small_fleet: int,
    run_blocks: int,
    join_first: bool,
    config: KvAwareConfig,
    fleet: list[tuple[int, int, list[tuple[int, str, bool]], float | None, int, int]],
    stores: list[str | None],
    prompt_blocks: int,
    now: float,
    eligible_mask: int,
) -> None:
    """Workers loading from two shared stores and none: a member is matched through what
    any member stored, in the groups of the walk as in each worker's own."""
    routing, loads = build(fleet, small_fleet, config, stores, join_first)
    assert_fast_equals_exhaustive_for(routing, loads, eligible_mask, prompt_blocks, now, run_blocks)
    routing.index.check()


shared = st.tuples(
    st.integers(0, 4),  # in-flight requests
    st.integers(0, 3000),  # guarded prefill tokens
    st.sampled_from([0, 4, 4, 12]),  # device blocks of the prompt: many share a depth
    st.one_of(st.none(), st.floats(0.0, 0.5)),
    st.sampled_from([0, 0, 800]),
)


@settings(max_examples=300, deadline=None)
@given(
    fleet=st.lists(shared, min_size=3, max_size=30),
    prompt_blocks=st.integers(1, 12),
    now=st.floats(0.0, 0.8),
)
def test_many_holders_of_one_depth_reduce_to_the_lightest(
    fleet: list[tuple[int, int, int, float | None, int]], prompt_blocks: int, now: float
) -> None:
    """A popular prefix held on device by many workers to the same depth: only the
    lightest of each group are predicted, and the choice is still the reference's."""
    routing, loads = build(
        [
            (requests, tokens, [(depth, "device", False)] if depth else [], queued, 0, others)
            for requests, tokens, depth, queued, others in fleet
        ]
    )
    assert_fast_equals_exhaustive(routing, loads, PROMPT[:prompt_blocks], now)


def assert_fast_equals_exhaustive(
    routing: KvAwareRouting, workers: list[WorkerLoad], hashes: list[int], now: float
) -> None:
    """The same smallest (TTFT, load) and reason; the same worker unless tied."""
    tokens = len(hashes) * BLOCK + 7
    ids = [w.worker_id for w in workers]
    reference = lowest_ttft(
        workers,
        routing.index.match(hashes, ids, now),
        {w: routing.queue.queued_s(w, now) for w in ids},
        tokens,
        BLOCK,
        hashes[-1] if hashes else tokens,
        routing.config,
    )
    fast = routing.best(workers, hashes, tokens, BLOCK, now)

    def rank(choice_ttft: float, load: WorkerLoad) -> tuple[float, tuple[int, int]]:
        return (round(choice_ttft, 9), load.sort_key)

    expected = rank(reference.prediction.ttft_s, reference.prediction.worker)
    assert rank(fast.prediction.ttft_s, fast.prediction.worker) == expected
    assert fast.reason == reference.reason
    everyone = routing.index.match(hashes, ids, now)
    predictions = [
        predict(
            w,
            everyone[w.worker_id],
            tokens,
            BLOCK,
            routing.queue.queued_s(w.worker_id, now),
            routing.config,
        )
        for w in workers
    ]
    tied = [p for p in predictions if rank(p.ttft_s, p.worker) == expected]
    if len(tied) == 1:
        assert fast.worker_id == reference.worker_id
        assert fast.prediction == reference.prediction


def test_holders_found_in_one_walk_equal_each_workers_walk() -> None:
    routing, _ = build(
        [
            (0, 0, [(12, "device", False)], None, 0, 0),
            (0, 0, [(5, "host", False), (3, "device", False)], None, 9, 0),
            (0, 0, [(2, "storage", True)], None, 0, 0),
            (0, 0, [], None, 4, 0),
            (0, 0, [], None, 0, 0),
        ]
    )
    everyone = routing.index.match(PROMPT, [f"w{i}" for i in range(5)], now=0.0)
    holders = routing.index.match_holders(PROMPT, now=0.0)
    assert holders == {w: m for w, m in everyone.items() if m.num_blocks}
    assert set(holders) == {"w0", "w1", "w2", "w3"}


def test_an_idle_fleet_spreads_its_misses_over_all_of_it() -> None:
    routing = KvAwareRouting(CONFIG)
    workers = [WorkerLoad(f"w{i}") for i in range(50)]
    chosen = {routing.best(workers, [p], BLOCK + 1, BLOCK, 0.0).worker_id for p in range(400)}
    assert len(chosen) > 40


def test_workers_first_seen_by_a_whole_fleets_decision_hold_nothing() -> None:
    """A fleet predicted whole reads each worker's depth from the walk's layers by its
    slot's byte; workers first seen in the decision get slots past the layers' bytes and
    are predicted as holding nothing, not read out of range."""
    routing, known = build([(1, 200 * i, [(4, "device", False)], None, 0, 0) for i in range(3)])
    routing.small_fleet = SMALL_FLEET
    newcomers = [WorkerLoad(f"n{i}", 1, 10) for i in range(30)]
    assert_fast_equals_exhaustive(routing, known + newcomers, PROMPT[:6], now=0.0)
    assert routing.best(known + newcomers, PROMPT[:6], 6 * BLOCK + 7, BLOCK, 0.0).reason in {
        "cache_hit",
        "load_spread",
    }


def test_a_worker_learnt_from_select_then_follows_load_changes() -> None:
    routing = KvAwareRouting(CONFIG)
    routing.small_fleet = 0  # learnt by the load orders, not predicted whole
    idle = [WorkerLoad("w0"), WorkerLoad("w1")]
    routing.best(idle, [], 10, BLOCK, 0.0)
    busy_w0 = WorkerLoad("w0", 3, 500)
    routing.loads.update(busy_w0)
    for prompt in range(20):
        choice = routing.best([busy_w0, WorkerLoad("w1")], [prompt], BLOCK + 1, BLOCK, 0.0)
        assert choice.worker_id == "w1"


def test_the_lightest_queue_is_found_behind_a_drained_worker_further_in_both_orders() -> None:
    """At 0.5 s, c's queue is drained and its one request is the lightest term; it is
    second by requests (behind a, none in flight but queued to 0.9 s) and second by queue end
    (behind b, drained earlier but with 3 requests): one step in each order is not
    enough. Guards are heavy everywhere, so they do not cap the queue terms."""
    routing = KvAwareRouting(CONFIG)
    routing.small_fleet = 0  # found by walking the load orders
    loads = [WorkerLoad("a", 0, 9000), WorkerLoad("b", 3, 9000), WorkerLoad("c", 1, 9000)]
    for load in loads:
        routing.loads.update(load)
    routing.queue.push("a", 0.9, now=0.0)
    routing.queue.push("c", 0.45, now=0.0)
    assert routing.best(loads, [], 10, BLOCK, now=0.5).worker_id == "c"


@settings(max_examples=150, deadline=None)
@given(
    fleet=st.lists(shared, min_size=20, max_size=80),
    prompt_blocks=st.integers(1, 12),
    now=st.floats(0.0, 0.8),
)
@pytest.mark.parametrize("small_fleet", [0, SMALL_FLEET])  # searched; predicted whole
@CONFIGS
def test_a_large_group_of_holders_reduces_to_its_lightest(
    small_fleet: int,
    config: KvAwareConfig,
    fleet: list[tuple[int, int, int, float | None, int]],
    prompt_blocks: int,
    now: float,
) -> None:
    """Groups of tens of holders sharing one match, their lightest found from the load
    terms the load order keeps (or every worker read from the walk's layers): the choice
    is still the reference's."""
    routing, loads = build(
        [
            (requests, tokens, [(depth, "device", False)] if depth else [], queued, 0, others)
            for requests, tokens, depth, queued, others in fleet
        ],
        small_fleet,
        config,
    )
    assert_fast_equals_exhaustive(routing, loads, PROMPT[:prompt_blocks], now)


@settings(max_examples=150, deadline=None)
@given(
    fleet=st.lists(shared, min_size=20, max_size=80),
    prompt_blocks=st.integers(1, 12),
    now=st.floats(0.0, 0.8),
    left_out=st.sets(st.integers(0, 79), max_size=60),
)
def test_a_large_group_reduces_to_its_lightest_eligible_holder(
    fleet: list[tuple[int, int, int, float | None, int]],
    prompt_blocks: int,
    now: float,
    left_out: set[int],
) -> None:
    """Holders the router did not offer (taken out, tried) are still in the index's
    groups and often the lightest: the search passes over them."""
    routing, loads = build(
        [
            (requests, tokens, [(depth, "device", False)] if depth else [], queued, 0, others)
            for requests, tokens, depth, queued, others in fleet
        ]
    )
    workers = [w for i, w in enumerate(loads) if i not in left_out] or loads[:1]
    assert_fast_equals_exhaustive(routing, workers, PROMPT[:prompt_blocks], now)


def test_the_lightest_holders_left_out_of_a_large_group_are_passed_over() -> None:
    """30 workers hold the prompt's first 4 blocks; the 10 idle ones, the group's
    lightest, are not offered: the choice is the lightest of the others, not a worker
    the router did not offer."""
    routing, loads = build(
        [
            (0 if i < 10 else 1, 0 if i < 10 else 100 * i, [(4, "device", False)], None, 0, 0)
            for i in range(30)
        ]
    )
    offered = loads[10:]
    choice = routing.best(offered, PROMPT[:6], 6 * BLOCK + 7, BLOCK, now=0.0)
    assert choice.worker_id == "w10"  # 1 request, the fewest guarded tokens
    assert_fast_equals_exhaustive(routing, offered, PROMPT[:6], now=0.0)


def test_workers_replacing_forgotten_ones_in_a_large_group_are_ranked_by_their_own_loads() -> None:
    """Workers that left free their slots in the index's masks and the load arrays;
    newcomers take them: the group's search reads the newcomers' terms, not the old."""
    routing, loads = build([(1, 100 * i, [(4, "device", False)], None, 0, 0) for i in range(30)])
    for gone in range(5):
        routing.forget_worker(f"w{gone}")
    newcomers = [WorkerLoad(f"n{i}", 2, 50 * i) for i in range(5)]  # heavier than any left
    for seq, load in enumerate(newcomers, start=1):
        routing.loads.update(load)
        routing.index.apply(load.worker_id, KVEvent(seq, "stored", "device", tuple(PROMPT[:4])))
    offered = loads[5:] + newcomers
    assert routing.best(offered, PROMPT[:6], 6 * BLOCK + 7, BLOCK, now=0.0).worker_id == "w5"
    assert_fast_equals_exhaustive(routing, offered, PROMPT[:6], now=0.0)


@pytest.mark.parametrize("run_blocks", [0, 1, kv_index.RUN_BLOCKS])
@settings(max_examples=200, deadline=None)
@given(
    fleet=st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(0, 11), st.integers(1, 12), st.sampled_from(TIERS))),
            st.integers(0, 12),
        ),
        min_size=1,
        max_size=40,
    ),
    prompt_blocks=st.integers(0, 12),
)
def test_a_walk_of_the_prompt_equals_each_workers_walk(
    run_blocks: int, fleet: list[tuple[list[tuple[int, int, str]], int]], prompt_blocks: int
) -> None:
    """Up to 40 workers holding runs of the prompt (not only prefixes) in every tier, and
    speculative prefixes (past 10 workers, one holder is stored as ``~bit``); the walk
    follows the workers still matching as one mask or, with few blocks per worker left
    (``RUN_BLOCKS``), each alone: each worker's match either way."""
    routing = KvAwareRouting(CONFIG)
    for i, (runs, speculative) in enumerate(fleet):
        for seq, (start, count, tier) in enumerate(runs, start=1):
            hashes = tuple(PROMPT[start : start + count])
            routing.index.apply(f"w{i}", KVEvent(seq, "stored", tier, hashes, None))
        routing.index.speculate(f"w{i}", PROMPT[:speculative], deadline=0.5)
    hashes = PROMPT[:prompt_blocks]
    ids = [f"w{i}" for i in range(len(fleet))]
    everyone = routing.index.match(hashes, ids, now=0.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_index, "RUN_BLOCKS", run_blocks)
        holders = routing.index.match_holders(hashes, now=0.0)
    assert holders == {w: m for w, m in everyone.items() if m.num_blocks}


@settings(max_examples=150, deadline=None)
@given(
    fleet=st.lists(worker, min_size=2, max_size=10),
    steps=st.lists(
        st.tuples(
            st.integers(1, 12),  # the request's prompt blocks
            st.floats(0.0, 0.3),  # seconds since the previous one
            st.integers(0, 9),  # a worker whose guards change after it
            st.integers(0, 3),  # to this many in-flight requests
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_decisions_in_a_row_stay_exact_as_their_records_and_loads_change(
    fleet: list[tuple[int, int, list[tuple[int, str, bool]], float | None, int, int]],
    steps: list[tuple[int, float, int, int]],
) -> None:
    """Each decision queues its prefill and speculates its blocks, then a worker's guards
    change: the load orders, brought up to date only when a decision searches them, give
    the reference's choice at every step (queues ending between decisions included)."""
    routing, loads = build(fleet)
    now = 0.0
    for prompt_blocks, elapsed, changed, requests in steps:
        now += elapsed
        hashes = PROMPT[:prompt_blocks]
        assert_fast_equals_exhaustive(routing, loads, hashes, now)
        choice = routing.select(loads, hashes, len(hashes) * BLOCK + 7, BLOCK, now)
        assert choice.worker_id in {w.worker_id for w in loads}
        i = changed % len(loads)
        loads[i] = WorkerLoad(loads[i].worker_id, requests, 400 * requests)
        routing.loads.update(loads[i])


@settings(max_examples=200, deadline=None)
@given(
    fleet=st.lists(worker, min_size=1, max_size=12),
    prompt_blocks=st.integers(0, 12),
    now=st.floats(0.0, 0.8),
    changed=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 3000), st.integers(0, 5000)), max_size=12
    ),
)
def test_predictions_from_the_kept_load_terms_equal_the_reference_bit_for_bit(
    fleet: list[tuple[int, int, list[tuple[int, str, bool]], float | None, int, int]],
    prompt_blocks: int,
    now: float,
    changed: list[tuple[int, int, int]],
) -> None:
    """The load terms are kept once, in :class:`LoadOrder`'s entries; a prediction from
    them is the reference's float exactly, for the loads it was told of and for load
    objects it sees first in a decision (new values it learns there)."""
    routing, loads = build(fleet)
    for i, (requests, tokens, others) in enumerate(changed[: len(loads)]):
        loads[i] = WorkerLoad(loads[i].worker_id, requests, tokens, 1.0, others)
    hashes = PROMPT[:prompt_blocks]
    matches = routing.index.match(hashes, [w.worker_id for w in loads], now)
    # no prompt tokens: the prediction is the load term alone, no addition to hide its
    # last bit
    for tokens in (len(hashes) * BLOCK + 7, 0, len(hashes) * BLOCK + 7):  # learnt, read back
        scored = routing._score([(w, matches[w.worker_id]) for w in loads], tokens, BLOCK, now)
        for w, ttft, cached in scored:
            queued = routing.queue.queued_s(w.worker_id, now)
            assert (ttft, cached) == _ttft(w, matches[w.worker_id], tokens, BLOCK, queued, CONFIG)
            assert routing.loads.entries[w.worker_id].load is w


near_floats = st.sampled_from([0.0, 1e-9, 1.5e-9, 2e-9, 2.5e-9, 0.05, 0.05 + 1e-9, 0.3])
group = st.tuples(
    st.sampled_from([0.0, 1e-9, 0.05, 0.1]),  # the group's prefill seconds
    st.sampled_from([0, 16, 32]),  # its cached tokens
    st.lists(st.tuples(near_floats, st.integers(0, 2), st.integers(0, 1)), max_size=6),
)


def whole_fleet_of(
    groups: list[tuple[float, int, list[tuple[float, int, int]]]],
    apart: list[tuple[float, int, int]],
) -> _WholeFleet:
    """Generated groups (prefill seconds, cached tokens, (term, requests, tokens) per
    member) and holders apart ((TTFT, cached tokens, tokens)) as a whole fleet."""
    names = iter(range(10**6))

    def load(requests: int, tokens: int) -> WorkerLoad:
        return WorkerLoad(f"w{next(names)}", requests, tokens)

    return _WholeFleet(
        [
            (prefill_s, cached, [t for t, _, _ in members], [load(r, k) for _, r, k in members])
            for prefill_s, cached, members in groups
        ],
        [(load(1, k), ttft, cached) for ttft, cached, k in apart],
    )


@settings(max_examples=500, deadline=None)
@given(
    groups=st.lists(group, min_size=1, max_size=4),
    apart=st.lists(st.tuples(near_floats, st.sampled_from([16, 48]), st.integers(0, 1))),
    tie_key=st.integers(0, 2**64),
)
def test_a_whole_fleets_choice_from_its_groups_equals_the_choice_from_every_score(
    groups: list[tuple[float, int, list[tuple[float, int, int]]]],
    apart: list[tuple[float, int, int]],
    tie_key: int,
) -> None:
    """Load terms and TTFTs within nanoseconds of each other, across groups and apart:
    the groups' shortcut (the smallest per group, a loose count) picks exactly what
    ranking every worker's score picks, ties and their rendezvous included."""
    fleet = whole_fleet_of(groups, apart)
    scored = fleet.scored()
    if not scored:
        return
    assert _choose_whole(fleet, tie_key) == _choose(scored, tie_key, 64, UNWEIGHTED)


@settings(max_examples=500, deadline=None)
@given(
    groups=st.lists(group, min_size=1, max_size=4),
    apart=st.lists(st.tuples(near_floats, st.sampled_from([16, 48]), st.integers(0, 1))),
    tie_key=st.integers(0, 2**64),
    home=st.sampled_from([0.0, 3.0]),
    weight=st.sampled_from([0.0, 0.5, 3.0]),
    prompt_tokens=st.sampled_from([0, 48, 64]),
)
def test_a_whole_fleets_weighted_choice_from_its_groups_equals_the_choice_from_every_score(
    groups: list[tuple[float, int, list[tuple[float, int, int]]]],
    apart: list[tuple[float, int, int]],
    tie_key: int,
    home: float,
    weight: float,
    prompt_tokens: int,
) -> None:
    """With a recompute weight or a home term, the groups' shortcut (a group's smallest
    score from its smallest load term, only near groups scored per worker) picks exactly
    what ranking every worker's score picks."""
    config = dataclasses.replace(CONFIG, home_weight=home)
    fleet = whole_fleet_of(groups, apart)
    scored = fleet.scored()
    if not scored:
        return
    expected = _choose(scored, tie_key, prompt_tokens, config, weight)
    deepest = fleet.deepest()
    assert deepest == max(cached for _, _, cached in scored)
    chosen = _choose_whole_weighted(fleet, deepest, tie_key, prompt_tokens, config, weight)
    assert chosen == expected
    by_worker = lambda s: s[0].worker_id  # noqa: E731
    assert sorted(fleet.deepest_holders(deepest), key=by_worker) == sorted(
        _deepest_holders(scored), key=by_worker
    )


@pytest.mark.parametrize("small_fleet", [0, SMALL_FLEET])  # searched; predicted whole
def test_a_queue_end_recorded_before_a_workers_first_load_is_predicted(small_fleet: int) -> None:
    """A peer replica's choice can queue prefill on a worker this replica has not seen
    loads for yet: the worker's load entry, made later, starts from that queue end."""
    routing = KvAwareRouting(UNWEIGHTED)
    routing.small_fleet = small_fleet
    routing.queue.push("a", 0.4, now=0.0)  # before any load of "a"
    loads = [WorkerLoad("a", 1, 9000), WorkerLoad("b", 1, 9000)]
    assert routing.best(loads, [], 10, BLOCK, now=0.1).worker_id == "b"
    assert routing.loads.entries["a"].done_at == pytest.approx(0.4)
    assert_fast_equals_exhaustive(routing, loads, [], now=0.1)
