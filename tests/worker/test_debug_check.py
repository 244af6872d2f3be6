"""``/debug/check``: bounded so nobody can stall the engine with it, and real checks that
``python -O`` cannot remove."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from kvserve.router.local_fleet import ServerProcess
from kvserve.worker.debug_check import CheckBudget, CheckRefused
from tests.worker.worker_process import api


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_the_next_check_waits_ten_times_the_last_ones_duration() -> None:
    clock = Clock()
    budget = CheckBudget(clock)

    async def check_taking(seconds: float) -> None:
        clock.now += seconds

    await budget.run(lambda: check_taking(0.01))
    clock.now += 0.05
    with pytest.raises(CheckRefused) as refused:
        await budget.run(lambda: check_taking(0.01))
    assert refused.value.retry_after_s == pytest.approx(0.05)
    clock.now += 0.051
    await budget.run(lambda: check_taking(0.01))  # 0.1 s after a 0.01 s check: allowed


async def test_one_check_at_a_time_and_a_failed_check_still_counts() -> None:
    clock = Clock()
    budget = CheckBudget(clock)
    started = asyncio.Event()
    release = asyncio.Event()

    async def slow() -> None:
        started.set()
        await release.wait()
        clock.now += 0.001

    running = asyncio.create_task(budget.run(slow))
    await started.wait()
    with pytest.raises(CheckRefused):
        await budget.run(slow)
    release.set()
    await running

    async def broken() -> None:
        clock.now += 0.001
        raise RuntimeError("boom")

    clock.now += 1.0
    with pytest.raises(RuntimeError):
        await budget.run(broken)
    with pytest.raises(CheckRefused):  # the failed check cost time too
        await budget.run(broken)


def test_back_to_back_calls_are_refused_with_an_openai_body(worker: ServerProcess) -> None:
    with api(worker) as client:
        answers = [client.get("/debug/check") for _ in range(20)]
    assert answers[0].status_code in (200, 429)
    assert {a.status_code for a in answers} <= {200, 429}
    refused = [a for a in answers if a.status_code == 429]
    assert refused, "20 checks back to back were all allowed"
    error = refused[0].json()["error"]
    assert error["code"] == "check_rate_limited" and "retry in" in error["message"]
    assert int(refused[0].headers["Retry-After"]) >= 1
    assert any(a.status_code == 200 and a.json() == {"ok": True} for a in answers)


_BROKEN_LEDGER = """
from kvserve.core.invariants import InvariantError
from kvserve.core.kv_cache_manager import KVCacheManager
cache = KVCacheManager(8, 4)
cache.allocate_slots("r", 8)
cache._ledger._state[cache.block_table("r")[0]] = 0  # a block owned by r now reads free
try:
    cache.check()
except InvariantError as error:
    print("caught:", error)
"""


def test_checks_still_run_under_python_dash_o() -> None:
    result = subprocess.run(
        [sys.executable, "-O", "-c", _BROKEN_LEDGER],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.startswith("caught: "), result.stdout + result.stderr
