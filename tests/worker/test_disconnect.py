"""Clients that hang up mid-generation abort their requests and free their blocks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import orjson

from kvserve.router.local_fleet import ServerProcess
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
    assert httpx.get(f"{worker.url}/debug/check", headers=AUTH).json() == {"ok": True}


def test_fifty_streaming_clients_cut_off_free_every_block(worker: ServerProcess) -> None:
    received = asyncio.run(run_clients(worker, served_model(worker)))
    assert received == [CHUNKS_BEFORE_HANGING_UP] * NUM_CLIENTS
    assert_every_block_free_or_cached(worker)
    # The engine frees a request's blocks as soon as its output stream is dropped; the
    # handler counts the abort when its cancelled generator is closed, a moment later.
    expected = f'kvserve_requests_total{{finish_reason="abort"}} {NUM_CLIENTS:.1f}'
    deadline = time.monotonic() + 30
    while expected not in (metrics := httpx.get(f"{worker.url}/metrics", headers=AUTH).text):
        counted = [m for m in metrics.splitlines() if m.startswith("kvserve_requests_total")]
        assert time.monotonic() < deadline, counted
        time.sleep(0.05)


def test_non_streaming_client_that_hangs_up_is_aborted(worker: ServerProcess) -> None:
    body = {"model": served_model(worker), "prompt": [7, 8, 9], "max_tokens": 3000}
    body["ignore_eos"] = True
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(f"{worker.url}/v1/completions", json=body, headers=AUTH, timeout=0.5)
    assert_every_block_free_or_cached(worker)


FIRST_TOKEN = {"x-kvserve-first-token": "headers"}


def test_headers_sent_with_the_first_token_then_the_whole_answer(worker: ServerProcess) -> None:
    """Asked by a router, a non-streamed answer's headers come while it still generates,
    and the body that follows is the same answer as without the request."""
    body = {"model": served_model(worker), "prompt": [5, 6, 7], "max_tokens": 400}
    body |= {"ignore_eos": True, "temperature": 0}
    with httpx.stream(
        "POST", f"{worker.url}/v1/completions", json=body, headers=AUTH | FIRST_TOKEN, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-kvserve-first-token"] == "1"
        assert "content-length" not in response.headers
        running_at_headers = load(worker)["running"]
        early = orjson.loads(response.read())
    plain = httpx.post(f"{worker.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert "x-kvserve-first-token" not in plain.headers
    assert running_at_headers == 1  # still generating its 400 tokens
    assert early["usage"]["completion_tokens"] == 400
    assert early["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert_every_block_free_or_cached(worker)


def aborted(worker: ServerProcess) -> float:
    metrics = httpx.get(f"{worker.url}/metrics", headers=AUTH).text
    line = 'kvserve_requests_total{finish_reason="abort"} '
    return sum(float(row[len(line) :]) for row in metrics.splitlines() if row.startswith(line))


def test_a_client_gone_after_the_first_token_headers_is_aborted(worker: ServerProcess) -> None:
    body = {"model": served_model(worker), "prompt": [9, 8, 7], "max_tokens": 3000}
    body["ignore_eos"] = True
    before = aborted(worker)
    with httpx.stream(
        "POST", f"{worker.url}/v1/completions", json=body, headers=AUTH | FIRST_TOKEN, timeout=60
    ) as response:
        assert response.headers["x-kvserve-first-token"] == "1"
    # Closed without reading: the generation of 3,000 tokens must not run on.
    assert_every_block_free_or_cached(worker)
    assert aborted(worker) == before + 1
