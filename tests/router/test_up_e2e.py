"""``kvserve up`` end to end: a fresh cache, real kvserve workers behind the router, the
cache-aware policy finding the worker that holds a prefix, and a clean stop on Ctrl-C or
SIGTERM that leaves no process behind."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from tests.support.ports import free_port

SYSTEM = "You are a careful assistant. Always answer in exactly one short sentence. " * 3


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvserve-cache")


def start_up(cache_dir: Path, *options: str) -> ServerProcess:
    port = free_port()
    process = ServerProcess(
        [*KVSERVE_COMMAND, "up", "--port", str(port), *options],
        f"http://127.0.0.1:{port}",
        name="up",
        env={"KVSERVE_CACHE_DIR": str(cache_dir)},
    )
    process.wait_healthy(timeout_s=180)
    deadline = time.monotonic() + 10
    while "kvserve is up" not in process.log_tail():
        assert time.monotonic() < deadline, process.log_tail()
        time.sleep(0.05)
    return process


def stop_and_check(up: ServerProcess, signum: int, worker_urls: list[str]) -> None:
    up.process.send_signal(signum)
    assert up.process.wait(timeout=40) == 0, up.log_tail()
    assert up.log_tail().endswith("stopped.")
    for url in [up.url, *worker_urls]:
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2.0)


@pytest.fixture(scope="module")
def fleet(cache_dir: Path) -> Iterator[tuple[ServerProcess, httpx.Client]]:
    up = start_up(cache_dir, "--workers", "2", "--policy", "cache_aware")
    with httpx.Client(base_url=up.url, timeout=60.0) as client:
        yield up, client
    up.stop()


def _chat(client: httpx.Client, system: str, question: str) -> httpx.Response:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body = {"model": "tiny-llama", "messages": messages, "max_tokens": 4}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def test_first_run_makes_the_tiny_model_in_the_cache(fleet, cache_dir: Path) -> None:
    up, _ = fleet
    assert (cache_dir / "models" / "tiny-llama" / "config.json").exists()
    assert "making the tiny model" in up.log_tail()
    assert "curl http://127.0.0.1:" in up.log_tail()


def test_cache_aware_sends_a_shared_prefix_to_the_worker_holding_it(fleet) -> None:
    _, client = fleet
    first = _chat(client, SYSTEM, "What is the capital of France?")
    second = _chat(client, SYSTEM, "Name a primary colour.")
    assert second.headers["x-kvserve-worker"] == first.headers["x-kvserve-worker"]
    assert "reason=cache_hit" in second.headers["x-kvserve-decision"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    unrelated = {
        _chat(client, f"{i} is my favourite number.", "Why?").headers["x-kvserve-worker"]
        for i in range(4)
    }
    assert unrelated == {"w0", "w1"}


def test_a_body_sent_without_a_json_content_type_still_works(fleet) -> None:
    _, client = fleet
    response = client.post(
        "/v1/completions",
        content=b'{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},  # what `curl -d` sends
    )
    assert response.status_code == 200, response.text


def test_ctrl_c_stops_everything(fleet) -> None:
    up, client = fleet
    worker_urls = [w["url"] for w in client.get("/workers").json()["workers"]]
    stop_and_check(up, signal.SIGINT, worker_urls)


def test_sigterm_stops_everything_and_the_cached_model_is_reused(cache_dir: Path) -> None:
    up = start_up(cache_dir, "--workers", "1")
    try:
        assert "making the tiny model" not in up.log_tail()
        worker_urls = [w["url"] for w in httpx.get(up.url + "/workers").json()["workers"]]
        assert len(worker_urls) == 1
        stop_and_check(up, signal.SIGTERM, worker_urls)
    finally:
        up.stop()
