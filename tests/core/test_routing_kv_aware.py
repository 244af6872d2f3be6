"""The kv_aware rule: predicted time to first token decides, exactly and reproducibly."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.kv_aware import KvAwareConfig, KvAwareRouting
from kvserve.core.routing.pool_loads import PoolLoads
from kvserve.core.routing.types import WorkerLoad

CONFIG = KvAwareConfig(  # the TTFT alone ranks (no recompute or home weight)
    prefill_token_s=1e-3,
    attention_pair_s=0.0,
    decode_request_s=0.0,
    recompute_weight=0.0,
    home_weight=0.0,
)
BLOCK = 16
HASHES = list(range(100, 110))  # a 10-block prefix
PROMPT = 10 * BLOCK + 5


def routing_with_holder(holder: str = "w0", blocks: int = 10) -> KvAwareRouting:
    routing = KvAwareRouting(CONFIG)
    routing.index.apply(holder, KVEvent(1, "stored", "device", tuple(HASHES[:blocks]), None))
    return routing


def idle(*ids: str) -> list[WorkerLoad]:
    return [WorkerLoad(w) for w in ids]


def test_holder_wins_on_an_idle_fleet() -> None:
    choice = routing_with_holder().select(idle("w0", "w1", "w2"), HASHES, PROMPT, BLOCK, now=0.0)
    assert (choice.worker_id, choice.reason) == ("w0", "cache_hit")
    assert choice.prediction.cached_tokens == 10 * BLOCK


def test_holder_loses_when_its_queue_makes_it_slower() -> None:
    """Queued work on the holder: 150 tokens of prefill beat 165 uncached elsewhere only
    until the holder's queue exceeds what its cache saves (160 tokens)."""
    busy_holder = [WorkerLoad("w0", 1, 150), WorkerLoad("w1")]
    routing = routing_with_holder()
    routing.queue.push("w0", 150 * CONFIG.prefill_token_s, now=0.0)
    assert routing.select(busy_holder, HASHES, PROMPT, BLOCK, now=0.0).worker_id == "w0"

    saturated = [WorkerLoad("w0", 3, 400), WorkerLoad("w1")]
    routing = routing_with_holder()
    routing.queue.push("w0", 400 * CONFIG.prefill_token_s, now=0.0)
    choice = routing.select(saturated, HASHES, PROMPT, BLOCK, now=0.0)
    assert (choice.worker_id, choice.reason) == ("w1", "load_spread")


@pytest.mark.parametrize(("queued_tokens", "chosen"), [(400, "w0"), (470, "w0"), (490, "w1")])
def test_recompute_weight_keeps_a_busy_holder_until_its_queue_outweighs_the_recompute(
    queued_tokens: int, chosen: str
) -> None:
    """Moving costs the 160 tokens the holder has cached, once as this request's TTFT and
    twice more as capacity (weight 2): the holder keeps it while its queue is under 480."""
    config = dataclasses.replace(CONFIG, recompute_weight=2.0)
    routing = KvAwareRouting(config)
    routing.index.apply("w0", KVEvent(1, "stored", "device", tuple(HASHES), None))
    routing.queue.push("w0", queued_tokens * config.prefill_token_s, now=0.0)
    loads = [WorkerLoad("w0", 3, queued_tokens), WorkerLoad("w1")]
    choice = routing.select(loads, HASHES, PROMPT, BLOCK, now=0.0)
    assert choice.worker_id == chosen
    assert choice.reason == ("cache_hit" if chosen == "w0" else "load_spread")


@pytest.mark.parametrize(("slack_s", "chosen"), [(0.3, "w0"), (0.2, "w1"), (0.0, "w1")])
def test_the_recompute_weight_applies_only_while_the_fleet_has_slack(
    slack_s: float, chosen: str
) -> None:
    """The holder's 480 guarded tokens are 240 ms of prefill for the mean worker of two:
    with slack up to 300 ms the recompute weight keeps the request on the holder; up to
    200 ms or none, the fleet is too busy for it and TTFT alone sends it to w1, as with no
    weight. The home weight's bound plays no part. A pool kept between decisions (its sum
    kept) decides as a list does."""
    config = dataclasses.replace(
        CONFIG, recompute_weight=2.0, recompute_slack_queue_s=slack_s, home_slack_queue_s=0.0
    )
    for kept in (False, True):
        routing = KvAwareRouting(config)
        routing.index.apply("w0", KVEvent(1, "stored", "device", tuple(HASHES), None))
        routing.queue.push("w0", 470 * config.prefill_token_s, now=0.0)
        loads = [WorkerLoad("w0", 3, 480), WorkerLoad("w1")]
        pool = PoolLoads(loads) if kept else loads
        assert routing.select(pool, HASHES, PROMPT, BLOCK, now=0.0).worker_id == chosen


def busy_holder_of(blocks: int, queued_ms: float, config: KvAwareConfig) -> str:
    """The choice between w0, holding the prompt's first ``blocks`` with ``queued_ms`` of
    prefill queued, and an idle w1 holding nothing."""
    routing = KvAwareRouting(config)
    routing.index.apply("w0", KVEvent(1, "stored", "device", tuple(HASHES[:blocks]), None))
    routing.queue.push("w0", queued_ms / 1000, now=0.0)
    loads = [WorkerLoad("w0", 1, round(queued_ms)), WorkerLoad("w1")]
    return routing.select(loads, HASHES, PROMPT, BLOCK, now=0.0).worker_id


@pytest.mark.parametrize(("home_slack_s", "chosen"), [(0.006, "w1"), (0.004, "w0")])
def test_the_home_weight_applies_only_while_the_fleet_has_its_own_slack(
    home_slack_s: float, chosen: str
) -> None:
    """The case below (w0 faster by 6 ms, the home weight sends the request to w1): w0's
    10 guarded tokens are 5 ms of prefill for the mean worker of two, so a home bound of
    6 ms lets the home weight apply and one of 4 ms leaves TTFT alone to rank, whatever
    the recompute weight's own (larger) bound."""
    home = dataclasses.replace(
        CONFIG, home_weight=3.0, home_slack_queue_s=home_slack_s, recompute_slack_queue_s=1.0
    )
    assert busy_holder_of(1, 10, home) == chosen


@pytest.mark.parametrize(("home", "recompute"), [(3.0, 0.0), (0.0, 2.0)])
def test_a_decision_past_the_one_weights_bound_is_unweighted_when_the_other_weight_is_0(
    home: float, recompute: float
) -> None:
    """Only one weight set, and the fleet past that weight's bound but within the other's:
    no weight applies, so the decision takes the unweighted paths (the TTFT-only config),
    not a weighted path with both weights 0."""
    bounds = {"home_slack_queue_s": 0.001, "recompute_slack_queue_s": 1.0}
    if recompute:
        bounds = {"home_slack_queue_s": 1.0, "recompute_slack_queue_s": 0.001}
    config = dataclasses.replace(CONFIG, home_weight=home, recompute_weight=recompute, **bounds)
    routing = KvAwareRouting(config)
    loads = [WorkerLoad("w0", 1, 100), WorkerLoad("w1")]  # 50 ms for the mean worker
    assert routing._weights_now(loads) is routing._ttft_only
    assert routing._weights_now(idle("w0", "w1")) is routing.config


def test_home_weight_starts_a_new_prefix_on_an_idle_worker_not_a_busy_holder_of_its_start() -> None:
    """w0 holds the first block (a shared system prompt) and has 10 ms queued: it is 6 ms
    faster for this request (159 against 165 ms), but the 149 tokens computed there make
    it their home, and the next requests extending them meet its wait: with home weight 3
    the wait counts 1 + 3 × 149/165 times (186 ms), so the idle worker gets them. The
    holder of the whole prefix (computing 5 tokens) counts it about once and keeps them."""
    assert busy_holder_of(1, 10, CONFIG) == "w0"
    home = dataclasses.replace(CONFIG, home_weight=3.0)
    assert busy_holder_of(1, 10, home) == "w1"
    assert busy_holder_of(10, 10, home) == "w0"


def test_with_a_home_weight_the_recompute_weight_scales_with_the_holders_share() -> None:
    """Recompute weight 2, home weight 1. A holder of the first block only (16 of 165
    tokens) with 15 ms queued scores 177.5 ms; w1 computes 16 tokens more, charged
    2 × 16/165 × 16 ms = 3.1 ms (168.1): w1. Unscaled (32 ms) the holder would keep it. A
    holder of all ten blocks with 300 ms queued scores 309 ms against w1's 475: it keeps
    the request that the TTFT alone would move (165 < 305 ms)."""
    weighted = dataclasses.replace(CONFIG, recompute_weight=2.0, home_weight=1.0)
    assert busy_holder_of(1, 15, weighted) == "w1"
    assert busy_holder_of(10, 300, weighted) == "w0"
    assert busy_holder_of(10, 300, CONFIG) == "w1"


def test_home_weight_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="home_weight"):
        KvAwareConfig(home_weight=-1.0)


def test_recompute_weight_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="recompute_weight"):
        KvAwareConfig(recompute_weight=-1.0)


def test_queue_drains_with_time_and_guards_cap_it() -> None:
    routing = routing_with_holder()
    routing.queue.push("w0", 1.0, now=0.0)
    assert routing.queue.queued_s("w0", now=0.4) == pytest.approx(0.6)
    # The router's guards say the work is done (first token came): no queue left.
    choice = routing.select([WorkerLoad("w0"), WorkerLoad("w1")], HASHES, PROMPT, BLOCK, now=0.4)
    assert choice.worker_id == "w0"


def test_host_hits_cost_their_load_time() -> None:
    config = KvAwareConfig(
        prefill_token_s=1e-3, attention_pair_s=0.0, host_load_token_s=2e-3, recompute_weight=0
    )
    routing = KvAwareRouting(config)
    routing.index.apply("w0", KVEvent(1, "stored", "host", tuple(HASHES), None))
    choice = routing.select(idle("w0", "w1"), HASHES, PROMPT, BLOCK, now=0.0)
    assert choice.worker_id == "w1"  # loading is slower than computing with these costs


def test_a_burst_follows_the_first_request_then_speculation_expires() -> None:
    routing = KvAwareRouting(CONFIG)
    workers = idle("w0", "w1", "w2", "w3")
    first = routing.select(workers, HASHES, PROMPT, BLOCK, now=0.0)
    assert first.reason == "cache_miss"
    sibling = routing.select(workers, HASHES[:8], 8 * BLOCK + 3, BLOCK, now=0.5)
    assert sibling.worker_id == first.worker_id
    assert sibling.prediction.cached_tokens == 8 * BLOCK
    # No stored event confirmed it: after the TTL the prediction is gone.
    later = routing.index.match(HASHES, [first.worker_id], now=CONFIG.speculative_ttl_s + 0.6)
    assert later[first.worker_id].num_blocks == 0


def test_two_replicas_fed_the_same_events_make_the_same_choices() -> None:
    replicas = [KvAwareRouting(CONFIG), KvAwareRouting(CONFIG)]
    events = [
        ("w1", KVEvent(1, "stored", "device", tuple(HASHES[:4]), None)),
        ("w2", KVEvent(1, "stored", "device", tuple(range(500, 520)), None)),
        ("w3", KVEvent(1, "stored", "device", tuple(HASHES[:2]), None)),
    ]
    for replica in replicas:
        for worker, event in events:
            replica.index.apply(worker, event)
    workers = idle("w0", "w1", "w2", "w3")
    queries = [HASHES, list(range(500, 510)), [9, 8, 7], [], list(range(500, 530))]
    for hashes in queries:
        picks = {
            r.select(workers, hashes, 16 * len(hashes) + 1, BLOCK, 0.0).worker_id for r in replicas
        }
        assert len(picks) == 1


def test_equal_predictions_go_to_the_less_loaded() -> None:
    routing = KvAwareRouting(CONFIG)
    workers = [WorkerLoad("w0", 5, 0), WorkerLoad("w1", 1, 0), WorkerLoad("w2", 3, 0)]
    assert routing.select(workers, [1, 2], 40, BLOCK, now=0.0).worker_id == "w1"


def test_forgotten_worker_keeps_no_state() -> None:
    routing = routing_with_holder()
    routing.queue.push("w0", 5.0, now=0.0)
    routing.forget_worker("w0")
    assert routing.queue.queued_s("w0", 0.0) == 0.0
    assert routing.index.num_blocks("w0") == 0


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError):
        KvAwareConfig(prefill_token_s=0.0)
    with pytest.raises(ValueError):
        KvAwareConfig(speculative_ttl_s=-1.0)


@pytest.mark.parametrize("attention_pair_s", [0.0, 1.06e-9])
@pytest.mark.parametrize("seconds", [0.0, 0.05, 0.4, 3.0])
def test_tokens_within_inverts_the_prefill_time(attention_pair_s: float, seconds: float) -> None:
    """What the slack test compares the guarded tokens against: the tokens whose prefill
    takes the slack."""
    config = dataclasses.replace(CONFIG, attention_pair_s=attention_pair_s)
    tokens = config.tokens_within(seconds)
    assert config.prefill_s(tokens) == pytest.approx(seconds, abs=1e-12)
    assert config.tokens_within(float("inf")) == float("inf")
