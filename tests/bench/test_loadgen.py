"""The load generator and client against a scripted loopback server: pacing, chats
that carry their answers, and every failure counted instead of crashing the run."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.bench.loadgen import LoadConfig, LoadGenerator
from kvserve.bench.metrics import summarize
from kvserve.bench.workloads import RequestSpec
from kvserve.router.ports import free_port
from tests.bench.scripted_server import ScriptedServer

SHARED = "the same long preamble for every prompt " * 4  # over one block of the server


def prompts(count: int, *, gap_s: float = 0.0, max_tokens: int = 3) -> list[RequestSpec]:
    return [
        RequestSpec(arrival_s=i * gap_s, max_tokens=max_tokens, prompt=f"{SHARED}{i}")
        for i in range(count)
    ]


def config(url: str, **overrides) -> LoadConfig:
    return LoadConfig(endpoint=url, model="scripted-model", request_timeout_s=5.0, **overrides)


async def test_open_loop_follows_scaled_timestamps() -> None:
    async with ScriptedServer() as server:
        outcome = await LoadGenerator(config(server.url, time_scale=0.5)).run(prompts(4, gap_s=0.4))
    starts = sorted(r.start_s for r in outcome.records)
    for expected, actual in zip([0.0, 0.2, 0.4, 0.6], starts, strict=True):
        assert expected <= actual < expected + 0.15  # never early; late only by loop lag
    assert outcome.stopped_by == "completed"
    assert all(
        r.ok and r.completion_tokens == 3 and r.worker == "scripted-0" for r in outcome.records
    )


async def test_records_measure_ttft_itl_usage_and_cache() -> None:
    async with ScriptedServer(token_delay_s=0.01) as server:
        outcome = await LoadGenerator(config(server.url, concurrency=1)).run(
            prompts(2, max_tokens=5)
        )
    first, second = sorted(outcome.records, key=lambda r: r.item)
    assert 0 < first.ttft_s < first.e2e_s
    assert len(first.itl_s) == 4 and all(gap >= 0 for gap in first.itl_s)
    assert sum(first.itl_s) >= 0.02  # the server spaced its 5 chunks 10 ms apart
    assert (first.prompt_tokens, first.completion_tokens) == (len(SHARED + "0") // 4, 5)
    assert first.cached_tokens == 0
    assert 0 < second.cached_tokens <= len(SHARED) // 4  # the shared prefix, no more


async def test_closed_loop_never_exceeds_its_concurrency() -> None:
    async with ScriptedServer(token_delay_s=0.01) as server:
        outcome = await LoadGenerator(config(server.url, concurrency=3)).run(prompts(12))
    assert len(outcome.records) == 12
    assert server.max_in_flight == 3


async def test_poisson_rate_sends_everything_open_loop() -> None:
    async with ScriptedServer() as server:
        outcome = await LoadGenerator(config(server.url, rate=200.0)).run(prompts(10))
    assert sorted(r.item for r in outcome.records) == list(range(10))


async def test_chat_second_turn_carries_the_first_answer() -> None:
    chat = RequestSpec(arrival_s=0, max_tokens=2, system=SHARED, user_turns=("hi", "more"))
    async with ScriptedServer() as server:
        outcome = await LoadGenerator(config(server.url, api_key="k", ignore_eos=True)).run([chat])
    assert [r.turn for r in outcome.records] == [0, 1]
    assert server.received[1]["messages"] == [
        {"role": "system", "content": SHARED},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": " x x"},
        {"role": "user", "content": "more"},
    ]
    assert all(body["ignore_eos"] is True for body in server.received)
    assert server.auth_headers == ["Bearer k", "Bearer k"]
    assert outcome.records[1].cached_tokens > 0  # the second turn reuses the first's prefix


async def test_errors_are_counted_and_the_run_goes_on() -> None:
    async with ScriptedServer(["ok", "http400", "cut", "ok"]) as server:
        outcome = await LoadGenerator(config(server.url, concurrency=1)).run(prompts(4))
    records = sorted(outcome.records, key=lambda r: r.item)
    assert [r.ok for r in records] == [True, False, False, True]
    assert records[1].status == 400
    assert records[1].error == "HTTP 400: max_tokens is too large"
    assert records[2].error.startswith("stream cut")
    assert records[2].ttft_s is not None  # it streamed before the cut
    summary = summarize(outcome.records, outcome.duration_s)
    assert (summary["errors"], summary["error_rate"]) == (2, 0.5)
    assert summary["error_kinds"] == {"HTTP 400": 1, "stream cut": 1}


async def test_a_failed_chat_turn_ends_its_chat() -> None:
    chat = RequestSpec(arrival_s=0, max_tokens=2, user_turns=("a", "b", "c"))
    async with ScriptedServer(["ok", "http400"]) as server:
        outcome = await LoadGenerator(config(server.url)).run([chat])
    assert [(r.turn, r.ok) for r in outcome.records] == [(0, True), (1, False)]


async def test_refused_connections_are_errors() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    outcome = await LoadGenerator(config(url, concurrency=2)).run(prompts(3))
    assert len(outcome.records) == 3
    assert all(
        r.error.startswith("connection failed") and r.status is None for r in outcome.records
    )


async def test_a_hanging_server_times_out_and_frees_the_connection() -> None:
    async with ScriptedServer(["hang"]) as server:
        slow = LoadConfig(endpoint=server.url, model="m", request_timeout_s=0.3)
        outcome = await LoadGenerator(slow).run(prompts(2))
        await server.wait_for_disconnects(1)
    records = sorted(outcome.records, key=lambda r: r.item)
    assert records[0].error.startswith("timeout") and records[1].ok
    assert server.disconnects == 1


async def test_stop_cancels_in_flight_requests_and_keeps_what_completed() -> None:
    async with ScriptedServer(["ok", "hang", "hang"]) as server:
        generator = LoadGenerator(config(server.url, concurrency=3))
        run = asyncio.create_task(generator.run(prompts(50)))
        while server.in_flight < 2 or not generator.records:
            await asyncio.sleep(0.01)
        generator.stop()
        outcome = await asyncio.wait_for(run, 5)
        await server.wait_for_disconnects(2)
    assert outcome.stopped_by == "interrupted"
    assert outcome.abandoned >= 2
    assert 1 <= len(outcome.records) < 50
    assert server.disconnects >= 2


async def test_duration_stops_issuing() -> None:
    async with ScriptedServer() as server:
        outcome = await LoadGenerator(config(server.url, duration_s=0.3)).run(
            prompts(100, gap_s=0.05)
        )
    assert outcome.stopped_by == "duration"
    assert 2 <= len(outcome.records) <= 6  # due at 0, 0.05, ..., 0.25 s: at most 6


async def test_a_run_that_ends_before_its_duration_completed() -> None:
    async with ScriptedServer() as server:
        outcome = await LoadGenerator(config(server.url, duration_s=30.0)).run(prompts(2))
    assert outcome.stopped_by == "completed" and len(outcome.records) == 2


@pytest.mark.parametrize(
    "overrides",
    [{"concurrency": 2, "rate": 1.0}, {"concurrency": 0}, {"rate": -1.0}, {"time_scale": 0.0}],
)
def test_bad_pacing_is_refused(overrides: dict) -> None:
    with pytest.raises(ValueError):
        LoadConfig(endpoint="http://x", model="m", **overrides)


async def test_a_bug_in_a_callback_surfaces_instead_of_vanishing() -> None:
    class BrokenProgress:
        def record(self, record) -> None:
            raise RuntimeError("progress sink broke")

        def item_done(self) -> None: ...

    async with ScriptedServer() as server:
        with pytest.raises(RuntimeError, match="progress sink broke"):
            await LoadGenerator(config(server.url), BrokenProgress()).run(prompts(2))
