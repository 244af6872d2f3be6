"""A router in front of workers started with ``--api-key``: with ``--worker-api-key`` it
serves, follows their KV events and reads their /metrics for the dashboard; without it,
its requests fail with a clear 502 naming the flag (no 500, no worker 401 passed off as
the client's)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port
from tests.support.metrics_text import samples
from tests.support.processes import start_router

WORKER_KEY = "fleet-key"
CLIENT_KEY = "client-key"
CLIENT = {"authorization": f"Bearer {CLIENT_KEY}"}
INDEX_BLOCKS = "kvserve_router_kv_index_blocks"
PROMPT = "The same long prompt, over and over. " * 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("keyed-model"), "llama")


@pytest.fixture(scope="module")
def workers(model_dir: Path) -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    try:
        for _ in range(2):
            port = free_port()
            args = [
                *KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port),
                "--runner", "sim", "--sim-profile", "tiny", "--num-blocks", "256",
                "--block-size", "16", "--served-model-name", "tiny", "--api-key", WORKER_KEY,
            ]  # fmt: skip
            server = ServerProcess(args, f"http://127.0.0.1:{port}", name="keyed-worker")
            started.append(server.wait_healthy(90))
        yield started
    finally:
        for server in started:
            server.stop()


def _router(workers: list[ServerProcess], model_dir: Path, *options: str) -> ServerProcess:
    urls = [w.url for w in workers]
    options = ("--tokenizer", str(model_dir), "--api-key", CLIENT_KEY, *options)
    return start_router(urls, free_port(), "--policy", "kv_aware", *options)


def _complete(router: ServerProcess) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    return httpx.post(router.url + "/v1/completions", json=body, headers=CLIENT, timeout=60)


def _wait_until(condition: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
    raise AssertionError(f"timed out waiting for {what}")


def test_router_with_the_workers_key_serves_follows_events_and_reads_metrics(
    workers: list[ServerProcess], model_dir: Path
) -> None:
    router = _router(workers, model_dir, "--worker-api-key", WORKER_KEY)
    try:
        first = _complete(router)
        assert first.status_code == 200, first.text
        holder = first.headers["x-kvserve-worker"]

        def indexed_blocks() -> float:  # from the worker's events, speculation not counted
            labels = frozenset({("worker", holder), ("tier", "device")})
            return samples(router.url + "/metrics").get((INDEX_BLOCKS, labels), 0.0)

        _wait_until(indexed_blocks, "the holder's KV events in the router's index")
        again = _complete(router)
        assert again.status_code == 200, again.text
        decision = again.headers["x-kvserve-decision"]
        assert float(decision.split("matched=")[1]) > 0, decision

        def kv_figures() -> list[Any]:
            data = httpx.get(router.url + "/dashboard/data", headers=CLIENT).json()
            figures = [w["kv"] for w in data["workers"]]
            return figures if all(f is not None for f in figures) else []

        assert len(_wait_until(kv_figures, "every worker's KV figures on the dashboard")) == 2
    finally:
        router.stop()


def test_router_without_the_workers_key_fails_clearly(
    workers: list[ServerProcess], model_dir: Path
) -> None:
    router = _router(workers, model_dir)
    try:
        refused = _complete(router)
        assert refused.status_code == 502, refused.text
        error = refused.json()["error"]
        assert error["code"] == "worker_refused_key"
        assert "--worker-api-key" in error["message"]
    finally:
        router.stop()


def test_the_workers_refuse_the_router_clients_key(workers: list[ServerProcess]) -> None:
    """The two keys are distinct: the client's key opens the router, not the workers."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    response = httpx.post(workers[0].url + "/v1/completions", json=body, headers=CLIENT)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
