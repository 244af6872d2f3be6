"""The recompute weight discounted by holder pressure: a holder that will have evicted the
prefix by the time the request runs is not waited for; one with room keeps its requests."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.future_cost import (
    CacheTurnover,
    HolderPressure,
    InFlightPrompts,
    keep_chance,
    room_chance,
)
from kvserve.core.routing.kv_aware import KvAwareConfig, KvAwareRouting
from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.types import PromptBlocks, RouteQuery, WorkerLoad

CONFIG = KvAwareConfig(
    prefill_token_s=1e-3,
    attention_pair_s=0.0,
    decode_request_s=0.0,
    recompute_weight=2.0,
    retention_margin=1.0,
    retention_window_s=60.0,
    home_weight=0.0,  # the recompute weight alone
    recompute_slack_queue_s=float("inf"),  # applied to every decision
)
BLOCK = 16
HASHES = tuple(range(100, 110))  # a 10-block prefix
PROMPT = 10 * BLOCK + 5
QUEUED = 470  # tokens queued on the holder: kept at weight 2 (< 480), lost at weight 0


def removed(count: int, first: int = 10_000) -> KVEvent:
    return KVEvent(2, "removed", "device", tuple(range(first, first + count)), None)


def busy_holder(config: KvAwareConfig = CONFIG) -> KvAwarePolicy:
    """w0 holds the prefix and 100 other blocks (a cache of 110 × 16 tokens once it
    evicts); w1 is idle and cold."""
    policy = KvAwarePolicy(config)
    others = tuple(range(1_000, 1_100))
    policy.observe_events("w0", [KVEvent(1, "stored", "device", HASHES + others, None)])
    return policy


def route(policy: KvAwarePolicy, now: float) -> tuple[str, str]:
    """Route the prompt at ``now``, when w0 has just been given QUEUED tokens of prefill."""
    policy.routing.queue.push("w0", QUEUED * policy.routing.config.prefill_token_s, now)
    loads = [WorkerLoad("w0", 3, QUEUED), WorkerLoad("w1")]
    query = RouteQuery("", blocks=PromptBlocks(PROMPT, HASHES, BLOCK))
    decision = policy.select(query, loads, now)
    return decision.worker_id, decision.reason


def evict_on_w0(policy: KvAwarePolicy, blocks_per_second: int, seconds: int) -> None:
    """w0 evicts other blocks at a steady rate, sampled by decisions that do not count
    (where the policy keeps the turnover: only with a discount to apply)."""
    future = policy.routing.future
    if future is not None:
        future.turnover.eviction_rate("w0", 0.0)
    for second in range(seconds):
        policy.observe_events("w0", [removed(blocks_per_second, 10_000 * (second + 1))])
        if future is not None:
            future.turnover.eviction_rate("w0", second + 1.0)


def test_a_holder_with_room_keeps_its_request() -> None:
    policy = busy_holder()
    assert route(policy, now=0.0) == ("w0", "cache_hit")


def test_a_holder_whose_cache_turns_over_faster_than_its_queue_is_not_waited_for() -> None:
    """110 blocks held, 500 evicted a second: a block unused for 0.22 s is gone, and the
    request would wait 0.47 s there, so the weight buys nothing and the TTFT decides."""
    policy = busy_holder()
    evict_on_w0(policy, blocks_per_second=500, seconds=5)
    assert route(policy, now=5.0) == ("w1", "load_spread")


def test_slow_turnover_keeps_the_holder() -> None:
    """1 block evicted every 10 s over 110 held: it keeps a block about 1,100 s, far
    beyond the 0.47 s wait, so the weight stays (almost) whole."""
    policy = busy_holder()
    turnover = policy.routing.future.turnover
    turnover.eviction_rate("w0", 0.0)
    for tenth in range(1, 7):
        policy.observe_events("w0", [removed(1, 10_000 * tenth)])
        turnover.eviction_rate("w0", tenth * 10.0)
    assert route(policy, now=60.0) == ("w0", "cache_hit")


def test_a_holder_whose_running_sequences_fill_its_cache_is_not_waited_for() -> None:
    """Its cache turns over slowly (it would keep the prefix), but the three requests in
    flight there pin 3 × 600 of its 1,760 tokens: this prompt would wait for room."""
    policy = busy_holder()
    evict_on_w0(policy, blocks_per_second=1, seconds=5)
    for _ in range(3):
        policy.routing.future.routed("w0", 600)
    assert route(policy, now=5.0) == ("w1", "load_spread")


def test_margin_zero_turns_the_discount_off() -> None:
    policy = busy_holder(dataclasses.replace(CONFIG, retention_margin=0.0))
    assert policy.routing.future is None  # nothing kept that no decision reads
    evict_on_w0(policy, blocks_per_second=500, seconds=5)
    assert route(policy, now=5.0) == ("w0", "cache_hit")


def test_weight_zero_keeps_nothing_for_the_discount() -> None:
    policy = KvAwarePolicy(dataclasses.replace(CONFIG, recompute_weight=0.0))
    assert policy.routing.future is None
    policy.observe_events("w0", [removed(10)])
    route(policy, now=0.0)


def test_eviction_rate_averages_removed_device_blocks_over_time() -> None:
    turnover = CacheTurnover(window_s=1e9)  # no decay: a plain average
    assert turnover.eviction_rate("w", 0.0) == 0.0
    assert turnover.retention_s("w", 100, 0.0) == math.inf
    turnover.observe("w", [removed(30), KVEvent(3, "removed", "host", (1, 2), None)])
    turnover.observe("w", [KVEvent(4, "cleared", "device", (), None)])  # a restart
    assert turnover.eviction_rate("w", 3.0) == pytest.approx(10.0)
    assert turnover.retention_s("w", 100, 3.0) == pytest.approx(10.0)
    assert turnover.eviction_rate("w", 6.0) == pytest.approx(5.0)  # 3 quiet seconds


def test_eviction_rate_forgets_the_past_over_its_window() -> None:
    turnover = CacheTurnover(window_s=10.0)
    turnover.eviction_rate("w", 0.0)
    turnover.observe("w", [removed(1000)])
    busy = turnover.eviction_rate("w", 1.0)
    assert turnover.eviction_rate("w", 100.0) < busy / 100


def test_removals_before_the_first_decision_have_no_span_and_are_not_counted() -> None:
    turnover = CacheTurnover(window_s=60.0)
    turnover.observe("w", [removed(1000)])
    assert turnover.eviction_rate("w", 5.0) == 0.0
    assert turnover.eviction_rate("w", 6.0) == 0.0


@pytest.mark.parametrize(
    ("capacity", "pinned", "prompt", "chance"),
    [
        (1000.0, 0, 100, 1.0),
        (1000.0, 950, 100, 0.5),
        (1000.0, 1200, 100, 0.0),
        (math.inf, 9, 1, 1.0),
    ],
)
def test_room_chance_is_the_share_of_the_prompt_that_fits(
    capacity: float, pinned: int, prompt: int, chance: float
) -> None:
    assert room_chance(capacity, pinned, prompt) == pytest.approx(chance)


def test_in_flight_prompts_are_the_latest_ones_sent() -> None:
    prompts = InFlightPrompts(keep=3)
    for size in (100, 200, 300, 400):
        prompts.routed("w", size)
    assert prompts.pinned_tokens("w", 2) == 700
    assert prompts.pinned_tokens("w", 5) == 900  # only three kept
    assert prompts.pinned_tokens("w", 0) == 0
    assert prompts.pinned_tokens("other", 3) == 0


@pytest.mark.parametrize(
    ("wait_s", "retention_s", "margin", "chance"),
    [
        (0.0, 1.0, 1.0, 1.0),
        (0.5, 1.0, 1.0, 0.5),
        (0.5, 1.0, 2.0, 0.0),
        (3.0, 1.0, 1.0, 0.0),
        (3.0, math.inf, 1.0, 1.0),
        (3.0, 1.0, 0.0, 1.0),
    ],
)
def test_keep_chance_ramps_from_one_to_zero(
    wait_s: float, retention_s: float, margin: float, chance: float
) -> None:
    assert keep_chance(wait_s, retention_s, margin) == pytest.approx(chance)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="margin"):
        KvAwareConfig(retention_margin=-1.0)
    with pytest.raises(ValueError, match="window"):
        KvAwareConfig(retention_window_s=0.0)
    with pytest.raises(ValueError, match="window"):
        HolderPressure(window_s=-1.0)


def test_a_removed_worker_forgets_its_turnover() -> None:
    routing = KvAwareRouting(CONFIG)
    routing.future.turnover.eviction_rate("w0", 0.0)
    routing.future.observe("w0", [removed(100)])
    assert routing.future.turnover.eviction_rate("w0", 1.0) > 0
    routing.forget_worker("w0")
    assert routing.future.turnover.eviction_rate("w0", 2.0) == 0.0


def test_a_pair_counts_the_prompt_on_the_decode_worker_that_will_hold_it() -> None:
    """Prefilled remotely, the prompt still ends up pinned in the decode worker's cache:
    its room must count it, as it does the prefill worker's."""
    policy = KvAwarePolicy(CONFIG)
    query = RouteQuery("", blocks=PromptBlocks(PROMPT, HASHES, BLOCK))
    decision = policy.select_pair(
        query, [WorkerLoad("d0")], [WorkerLoad("p0")], now=0.0, pd=PDConfig()
    )
    assert (decision.worker_id, decision.prefill_worker_id) == ("d0", "p0")
    in_flight = policy.routing.future.in_flight
    assert in_flight.pinned_tokens("d0", 1) == PROMPT
    assert in_flight.pinned_tokens("p0", 1) == PROMPT
