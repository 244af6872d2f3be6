"""Clients that hang up mid-generation abort their requests and free their blocks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx

from kvserve.router.local_fleet import ServerProcess
from tests.support.ledger_check import ledger_check
from tests.worker.worker_process import AUTH, load, served_model

NUM_CLIENTS = 50
CHUNKS_BEFORE_HANGING_UP = 3


async def stream_then_hang_up(client: httpx.AsyncClient, model: str, index: int) -> int:
    """Reads the first chunks of a long generation, then closes the connection."""
    body = {
        "model": model,
        "prompt": [100 + index, *range(200, 240)],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    received = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            received += line.startswith("data: ")
            if received == CHUNKS_BEFORE_HANGING_UP:
                break
    return received


async def run_clients(worker: ServerProcess, model: str) -> list[int]:
    async with httpx.AsyncClient(
        base_url=worker.url,
        headers=AUTH,
        limits=httpx.Limits(max_connections=NUM_CLIENTS),
        timeout=60.0,
    ) as client:
        return await asyncio.gather(
            *(stream_then_hang_up(client, model, i) for i in range(NUM_CLIENTS))
        )


def wait_until_idle(worker: ServerProcess, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        current = load(worker)
        idle = current["running"] == 0 and current["waiting"] == 0
        if idle or time.monotonic() > deadline:
            return current
        time.sleep(0.05)


def assert_every_block_free_or_cached(worker: ServerProcess) -> None:
    idle = wait_until_idle(worker)
    assert idle["running"] == 0
    assert idle["waiting"] == 0
    assert idle["free_blocks"] + idle["cached_blocks"] == idle["total_blocks"]
    assert ledger_check(worker.url, AUTH) == {"ok": True}


def aborted_requests(worker: ServerProcess) -> float:
    """The worker's count of aborted requests (0 before the first)."""
    metrics = httpx.get(f"{worker.url}/metrics", headers=AUTH).text
    prefix = 'kvserve_requests_total{finish_reason="abort"} '
    lines = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(lines[0].removeprefix(prefix)) if lines else 0.0


def test_fifty_streaming_clients_cut_off_free_every_block(worker: ServerProcess) -> None:
    before = aborted_requests(worker)  # the worker is shared: earlier tests abort too
    received = asyncio.run(run_clients(worker, served_model(worker)))
    assert received == [CHUNKS_BEFORE_HANGING_UP] * NUM_CLIENTS
    assert_every_block_free_or_cached(worker)
    assert aborted_requests(worker) - before == NUM_CLIENTS


def test_non_streaming_client_that_hangs_up_is_aborted(worker: ServerProcess) -> None:
    body = {"model": served_model(worker), "prompt": [7, 8, 9], "max_tokens": 3000}
    body["ignore_eos"] = True
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(f"{worker.url}/v1/completions", json=body, headers=AUTH, timeout=0.5)
    assert_every_block_free_or_cached(worker)
