"""Scheduler against a real KVCacheManager with a fake model: a deterministic next-token
function stands in for the forward pass, so every decision and every ledger state can be
checked after each step."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvserve.core.hashing import make_namespace
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.core.stop_checker import token_finish_reason

NAMESPACE = make_namespace("scheduler-test")


def next_token(tokens: Sequence[int]) -> int:
    """A stand-in model: the next token depends on the whole sequence."""
    return (sum(tokens) * 31 + len(tokens)) % 1000


class Driver:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 4,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 256,
        watermark: float = 0.0,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size)
        self.config = SchedulerConfig(max_num_batched_tokens, max_num_seqs, watermark)
        self.scheduler = Scheduler(self.kv, self.config)
        self.block_size = block_size
        self.finished: dict[str, Request] = {}
        self.outputs: list[SchedulerOutput] = []

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int = 4) -> Request:
        request = Request(
            request_id,
            prompt,
            SamplingParams(max_tokens=max_tokens),
            max_tokens=max_tokens,
            namespace=NAMESPACE,
            block_size=self.block_size,
        )
        self.scheduler.add(request)
        return request

    def step(self) -> SchedulerOutput:
        decoding = {r.request_id for r in self.scheduler.running if r.is_decoding}
        output = self.scheduler.schedule()
        assert output.num_scheduled_tokens <= self.config.max_num_batched_tokens
        order = [c.request.request_id in decoding for c in output.chunks]
        assert order == sorted(order, reverse=True), "a prefill chunk before a decode"
        assert len(self.scheduler.running) <= self.config.max_num_seqs
        for chunk in output.chunks:
            table = self.kv.block_table(chunk.request.request_id)
            assert len(table) * self.block_size >= chunk.start + chunk.num_tokens
        self.scheduler.advance(output)
        for chunk in output.chunks:
            if chunk.completes_sequence:
                request = chunk.request
                request.token_ids.append(next_token(request.token_ids))
                reason = token_finish_reason(request, eos_token_ids=())
                if reason is not None:
                    self.scheduler.finish(request, reason)
                    self.finished[request.request_id] = request
        for request in output.finished_before_run:
            self.finished[request.request_id] = request
        self.kv.check()
        self.outputs.append(output)
        return output

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def assert_nothing_leaked(self) -> None:
        """Every block is free or cached-and-unpinned once no request is left."""
        assert not self.scheduler.has_unfinished_requests()
        self.kv.check()
        assert self.kv.num_available_blocks == self.kv.num_blocks


def expected_output(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What the fake model generates for a request run alone."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def test_chunked_prefill_fills_the_budget_then_decodes():
    driver = Driver(num_blocks=16, max_num_batched_tokens=4)
    request = driver.add("a", list(range(10)), max_tokens=3)
    chunks = [(c.start, c.num_tokens) for c in driver.step().chunks]
    chunks += [(c.start, c.num_tokens) for c in driver.step().chunks]
    chunks += [(c.start, c.num_tokens) for c in driver.step().chunks]
    assert chunks == [(0, 4), (4, 4), (8, 2)]
    assert request.output_token_ids == expected_output(range(10), 1)
    driver.run()
    assert request.output_token_ids == expected_output(range(10), 3)
    assert request.finish_reason == "length"
    driver.assert_nothing_leaked()


def test_decodes_are_scheduled_before_prefill_chunks():
    driver = Driver(num_blocks=64, max_num_batched_tokens=8)
    driver.add("a", [1, 2], max_tokens=5)
    driver.step()
    driver.add("b", list(range(40)), max_tokens=1)
    output = driver.step()
    assert [(c.request.request_id, c.num_tokens) for c in output.chunks] == [("a", 1), ("b", 7)]


def test_prefix_of_a_finished_request_is_reused_with_exact_stats():
    driver = Driver(num_blocks=32)
    first = driver.add("a", list(range(12)), max_tokens=6)
    driver.run()
    second = driver.add("b", [*range(10), 7, 7, 7, 7, 7, 7], max_tokens=2)
    output = driver.step()
    assert second.num_cached_tokens == 8  # blocks [0..3], [4..7]; block 2 differs
    assert [(c.start, c.num_tokens) for c in output.chunks] == [(8, 8)]
    # A follow-up turn quoting the first answer hits the generated tokens too: 18 tokens,
    # 17 computed, so 4 full blocks were committed.
    follow_up = driver.add("c", [*first.token_ids, 5, 5, 5], max_tokens=2)
    driver.run()
    assert follow_up.num_cached_tokens == 16
    assert second.output_token_ids == expected_output(second.token_ids[:16], 2)
    stats = driver.scheduler.stats
    assert (stats.num_requests, stats.prompt_tokens, stats.cached_prompt_tokens) == (
        3,
        12 + 16 + 21,
        0 + 8 + 16,
    )
    driver.assert_nothing_leaked()


def test_identical_prompt_recomputes_its_last_block():
    driver = Driver(num_blocks=32)
    driver.add("a", list(range(8)), max_tokens=1)
    driver.run()
    again = driver.add("b", list(range(8)), max_tokens=2)
    output = driver.step()
    assert [(c.start, c.num_tokens) for c in output.chunks] == [(4, 4)]
    assert again.num_cached_tokens == 4
    driver.run()
    assert again.output_token_ids == expected_output(range(8), 2)


def test_preemption_takes_the_newest_and_resumes_from_its_cached_prefix():
    driver = Driver(num_blocks=7, max_num_batched_tokens=32)
    older = driver.add("a", list(range(8)), max_tokens=10)
    newer = driver.add("b", list(range(100, 108)), max_tokens=10)
    preempted: list[str] = []
    resumed_at: list[int] = []
    while driver.scheduler.has_unfinished_requests():
        output = driver.step()
        preempted += [r.request_id for r in output.preempted]
        resumed_at += [
            c.start for c in output.chunks if c.request is newer and c.num_tokens > 1 and preempted
        ]
    assert preempted and set(preempted) == {"b"}
    assert resumed_at and resumed_at[0] > 0  # its committed blocks were matched again
    assert older.output_token_ids == expected_output(range(8), 10)
    assert newer.output_token_ids == expected_output(range(100, 108), 10)
    assert driver.scheduler.stats.preemptions == len(preempted)
    # Resuming matched the newer one's own blocks: not a hit, and each request counts once.
    stats = driver.scheduler.stats
    assert (stats.num_requests, stats.prompt_tokens, stats.cached_prompt_tokens) == (2, 16, 0)
    assert newer.num_cached_tokens == 0
    driver.assert_nothing_leaked()


def test_watermark_holds_back_admission_while_others_run():
    driver = Driver(num_blocks=20, watermark=0.5)
    driver.add("a", list(range(16)), max_tokens=3)
    driver.step()
    big = driver.add("b", list(range(100, 140)), max_tokens=1)
    driver.step()
    assert big in driver.scheduler.waiting
    driver.run()
    assert big.output_token_ids == expected_output(range(100, 140), 1)


def test_a_request_that_matches_then_waits_for_room_counts_once():
    driver = Driver(num_blocks=6)
    driver.add("p", list(range(9)), max_tokens=1)
    driver.run()  # commits the blocks of tokens 0-3 and 4-7
    driver.add("a", list(range(100, 112)), max_tokens=5)
    driver.step()  # "a" holds 3 of the 4 free blocks, soon the 4th
    late = driver.add("b", [*range(8), *range(50, 58)], max_tokens=1)
    attempts = 0
    while late.num_cached_tokens is None:
        # Room for a match: it pins the cached 2 blocks, finds no room for the 2 new
        # ones, and releases them, until "a" finishes.
        assert driver.kv.num_available_blocks >= 1
        driver.step()
        attempts += 1
    assert attempts > 1 and late.num_cached_tokens == 8
    driver.run()
    stats = driver.scheduler.stats
    assert (stats.num_requests, stats.prompt_tokens, stats.cached_prompt_tokens) == (
        3,
        9 + 12 + 16,
        8,
    )
    driver.assert_nothing_leaked()


def test_request_larger_than_the_pool_is_rejected_alone():
    driver = Driver(num_blocks=4)
    too_big = driver.add("big", list(range(10)), max_tokens=10)
    fits = driver.add("ok", list(range(10)), max_tokens=2)
    output = driver.step()
    assert output.finished_before_run == [too_big]
    assert too_big.finish_reason == "length" and too_big.is_finished
    driver.run()
    assert fits.output_token_ids == expected_output(range(10), 2)
    driver.assert_nothing_leaked()


def test_abort_frees_blocks_at_once():
    driver = Driver(num_blocks=16, max_num_batched_tokens=8)
    running = driver.add("a", list(range(12)), max_tokens=4)
    waiting = driver.add("b", list(range(12)), max_tokens=4)
    driver.step()
    assert driver.kv.num_free_blocks < 16
    assert driver.scheduler.abort("a") is running
    assert driver.scheduler.abort("b") is waiting
    assert driver.scheduler.abort("unknown") is None
    assert running.finish_reason == waiting.finish_reason == "abort"
    driver.assert_nothing_leaked()


def test_max_num_seqs_caps_the_batch():
    driver = Driver(num_blocks=64, max_num_seqs=2)
    for i in range(3):
        driver.add(str(i), [i] * 5, max_tokens=2)
    assert len(driver.step().chunks) == 2
    driver.run()
    assert len(driver.finished) == 3


def test_duplicate_request_id_is_refused():
    driver = Driver(num_blocks=8)
    driver.add("a", [1, 2, 3])
    with pytest.raises(ValueError, match="duplicate"):
        driver.add("a", [1, 2, 3])


prompt_strategy = st.lists(st.integers(0, 3), min_size=1, max_size=30)


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(4, 24),
    budget=st.integers(1, 32),
    max_num_seqs=st.integers(1, 8),
    watermark=st.sampled_from([0.0, 0.1, 0.3]),
    arrivals=st.lists(
        st.tuples(st.integers(0, 4), prompt_strategy, st.integers(1, 12)), min_size=1, max_size=12
    ),
)
def test_random_workloads_under_memory_pressure(
    block_size, num_blocks, budget, max_num_seqs, watermark, arrivals
):
    driver = Driver(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        watermark=watermark,
    )
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    requests = {}
    step = 0
    while pending or driver.scheduler.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            index, (_, prompt, max_tokens) = pending.pop(0)
            requests[str(index)] = driver.add(str(index), prompt, max_tokens)
        decoding = [r for r in driver.scheduler.running if r.is_decoding]
        output = driver.step()
        if len(decoding) <= budget:
            served = {c.request.request_id for c in output.chunks}
            served |= {r.request_id for r in output.preempted}
            assert all(r.request_id in served for r in decoding)
        step += 1
        assert step < 5_000, "no progress"
    capacity = num_blocks * block_size
    for request_id, request in requests.items():
        _, prompt, max_tokens = arrivals[int(request_id)]
        if len(prompt) + max_tokens > capacity:
            assert request.finish_reason == "length" and not request.output_token_ids
        else:
            assert request.output_token_ids == expected_output(prompt, max_tokens)
    event(f"preempted: {driver.scheduler.stats.preemptions > 0}")
    event(f"prefix hits: {driver.scheduler.stats.cached_prompt_tokens > 0}")
    event(f"rejected: {any(o.finished_before_run for o in driver.outputs)}")
    driver.assert_nothing_leaked()


@pytest.mark.parametrize(
    "kwargs",
    [{"max_num_batched_tokens": 0}, {"max_num_seqs": 0}, {"watermark": 1.0}],
)
def test_config_rejects_unusable_limits(kwargs):
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


def test_a_shared_prefix_in_flight_is_computed_once_not_per_request():
    """Two requests behind one 16-token prefix arrive together: the second waits for the
    first to commit that prefix, then computes only its own tail."""
    driver = Driver(num_blocks=64, max_num_batched_tokens=64)
    prefix = list(range(100, 116))
    first = driver.add("a", [*prefix, 1, 2, 3], max_tokens=2)
    second = driver.add("b", [*prefix, 4, 5, 6], max_tokens=2)
    third = driver.add("c", [7, 8, 9], max_tokens=2)  # shares nothing: not held back
    output = driver.step()
    assert [(c.request.request_id, c.start) for c in output.chunks] == [("a", 0), ("c", 0)]
    output = driver.step()
    assert ("b", 16) in [(c.request.request_id, c.start) for c in output.chunks]
    driver.run()
    assert second.num_cached_tokens == 16
    # Prompts 19 + 3 (b past the shared prefix) + 3, then one decode step each.
    assert driver.scheduler.stats.computed_tokens == 19 + 3 + 3 + 3 * 1
    for request in (first, second, third):
        assert request.output_token_ids == expected_output(request.token_ids[:-2], 2)
    driver.assert_nothing_leaked()


def test_a_deferred_request_is_admitted_when_the_one_computing_its_prefix_is_aborted():
    driver = Driver(num_blocks=64, max_num_batched_tokens=8)
    prefix = list(range(100, 124))
    driver.add("a", [*prefix, 1], max_tokens=2)
    second = driver.add("b", [*prefix, 2], max_tokens=2)
    driver.step()  # a computes its first 8 tokens; b waits behind a's next blocks
    assert second in driver.scheduler.waiting
    driver.scheduler.abort("a")
    output = driver.step()
    assert [(c.request.request_id, c.start) for c in output.chunks] == [("b", 8)]
    driver.run()
    driver.assert_nothing_leaked()
