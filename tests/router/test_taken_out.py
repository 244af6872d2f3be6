"""Attempts waiting on a worker that is taken out fail as WorkerTakenOut (retried by the
proxy); a watch disarmed by an answer is left alone; a client's own cancellation stays a
cancellation."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.router.circuit_breaker import CircuitBreaker
from kvserve.router.config import CircuitBreakerConfig
from kvserve.router.taken_out import AnswerWatch, WorkerTakenOut, take_out
from kvserve.router.worker_registry import Worker


def worker() -> Worker:
    return Worker("w0", "http://127.0.0.1:1", CircuitBreaker(CircuitBreakerConfig()))


async def wait_for_answer(target: Worker, answered: asyncio.Event, disarm: bool) -> str:
    with AnswerWatch(target) as watch:
        await answered.wait()  # the answer's headers
        if disarm:
            watch.disarm()
        await asyncio.sleep(0.01)  # relaying the answer
    return "answered"


def test_waiting_attempts_fail_as_worker_taken_out_and_are_forgotten() -> None:
    async def scenario() -> None:
        target, answered = worker(), asyncio.Event()
        attempts = [asyncio.create_task(wait_for_answer(target, answered, True)) for _ in range(3)]
        await asyncio.sleep(0)  # all three wait
        assert len(target.waiting_for_answer) == 3
        assert take_out(target) == 3
        for attempt in attempts:
            with pytest.raises(WorkerTakenOut):
                await attempt
        assert not target.waiting_for_answer

    asyncio.run(scenario())


def test_an_answered_attempt_is_not_cut_by_a_later_take_out() -> None:
    async def scenario() -> None:
        target, answered = worker(), asyncio.Event()
        attempt = asyncio.create_task(wait_for_answer(target, answered, True))
        await asyncio.sleep(0)
        answered.set()
        await asyncio.sleep(0.001)  # it has disarmed and is relaying
        assert take_out(target) == 0
        assert await attempt == "answered"

    asyncio.run(scenario())


def test_a_client_leaving_stays_a_cancellation() -> None:
    async def scenario() -> None:
        target, answered = worker(), asyncio.Event()
        attempt = asyncio.create_task(wait_for_answer(target, answered, True))
        await asyncio.sleep(0)
        attempt.cancel()  # the client left (aiohttp cancels the handler)
        take_out(target)  # and the worker is taken out at the same moment
        with pytest.raises(asyncio.CancelledError):
            await attempt
        assert not target.waiting_for_answer

    asyncio.run(scenario())
