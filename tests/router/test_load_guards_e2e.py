"""Every way a request can end releases its load exactly once: the gauges return to zero.

One router (round robin, 1 s request timeout, one retry) over foreign servers A, B, C, run
as one process and as two (``--processes 2``: the gauges are the fleet's totals whichever
process answers; requests on fresh connections land on either).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.router.ports import free_port
from tests.support.metrics_text import by_label, samples
from tests.support.processes import ServerProcess, start_router

GAUGES = ("kvserve_router_in_flight_requests", "kvserve_router_in_flight_prefill_tokens")


@pytest.fixture(scope="module", params=[1, 2], ids=["1-process", "2-processes"])
def processes(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def router(foreign_fleet: list[ServerProcess], processes: int) -> Iterator[ServerProcess]:
    urls = [server.url for server in foreign_fleet]
    options = ["--policy", "round_robin", "--request-timeout", "1.0"]
    options += ["--max-retries", "1", "--retry-initial-backoff", "0.01"]
    with start_router(urls, free_port(), *options, "--processes", str(processes)) as process:
        yield process


@pytest.fixture
def client(router: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.url, timeout=10.0) as http:
        yield http
    assert_idle(router)


def held(router: ServerProcess) -> dict[str, dict[str, float]]:
    found = samples(router.url + "/metrics")
    return {gauge: by_label(found, gauge, "worker") for gauge in GAUGES}


def assert_idle(router: ServerProcess, within_s: float = 3.0) -> None:
    """Every in-flight gauge of every worker is back to exactly zero."""
    deadline = time.monotonic() + within_s
    while True:
        gauges = held(router)
        if all(value == 0 for per_worker in gauges.values() for value in per_worker.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"load still held: {gauges}")
        time.sleep(0.05)


def _retries(router: ServerProcess) -> float:
    """Retries counted by the router (with several processes, a scrape sums them all)."""
    found = samples(router.url + "/metrics")
    return sum(by_label(found, "kvserve_router_retries_total", "worker").values())


def test_success_streaming_and_not(client: httpx.Client, router: ServerProcess) -> None:
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        assert r.status_code == 200 and b"[DONE]" in r.read()
    assert_idle(router)
    gauges = held(router)
    assert set(gauges[GAUGES[0]]) >= {"w0", "w1"}  # the gauges exist per worker and read 0


def test_load_is_visible_while_held_and_prefill_goes_at_first_token(
    client: httpx.Client, router: ServerProcess
) -> None:
    body = {"prompt": "p" * 400, "stream": True, "x_test": {"tokens": 20, "token_delay": 0.03}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        worker = response.headers["x-kvserve-worker"]
        chunks = response.iter_bytes()  # keep it: a dropped iterator closes the stream
        next(chunks)
        during = held(router)
        assert during[GAUGES[0]][worker] == 1
        assert during[GAUGES[1]][worker] == 0  # the first token ended prefill
        assert b"[DONE]" in b"".join(chunks)
    body = {"prompt": "p" * 400, "x_test": {"delay": 0.8}}  # under --request-timeout
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, "/v1/completions", json=body)
        deadline = time.monotonic() + 10
        while (prefill := sum(held(router)[GAUGES[1]].values())) == 0:
            assert time.monotonic() < deadline and not pending.done(), "never held"
            time.sleep(0.01)
        assert prefill == 100  # 400 chars / 4, held while the answer is pending
        assert pending.result().status_code == 200


@pytest.mark.parametrize("status", [400, 404, 422, 501])
def test_upstream_error_not_retried_is_passed_through(
    client: httpx.Client, router: ServerProcess, status: int
) -> None:
    before = _retries(router)
    response = client.post("/v1/completions", json={"prompt": "x", "x_test": {"status": status}})
    assert response.status_code == status
    assert "injected" in response.json()["error"]["message"]
    assert _retries(router) == before


def test_retryable_upstream_error_is_retried_then_reported(
    client: httpx.Client, router: ServerProcess
) -> None:
    before = _retries(router)
    response = client.post("/v1/completions", json={"prompt": "x", "x_test": {"status": 503}})
    assert response.status_code == 503
    assert _retries(router) == before + 1


def test_retry_lands_on_another_worker(
    client: httpx.Client, router: ServerProcess, foreign_fleet: list[ServerProcess]
) -> None:
    failing = foreign_fleet[0]
    httpx.post(failing.url + "/admin/behavior", json={"status": 502})
    try:
        servers = set()
        for _ in range(6):
            response = client.post("/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200
            servers.add(response.json()["system_fingerprint"])
        assert "A" not in servers
    finally:
        httpx.post(failing.url + "/admin/behavior", json={"status": 0})


def test_timeout_answers_504(client: httpx.Client) -> None:
    started = time.monotonic()
    response = client.post("/v1/completions", json={"prompt": "x", "x_test": {"delay": 3}})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    assert time.monotonic() - started < 2.5


def test_timeout_mid_stream_ends_the_stream(client: httpx.Client) -> None:
    body = {"prompt": "x", "stream": True, "x_test": {"tokens": 50, "token_delay": 0.1}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        text = response.read()
    assert b"stream_broken" in text and b"[DONE]" not in text


def test_client_disconnect_mid_stream_releases_and_aborts_upstream(
    client: httpx.Client, router: ServerProcess, foreign_fleet: list[ServerProcess]
) -> None:
    body = {"prompt": "x", "stream": True, "x_test": {"tokens": 200, "token_delay": 0.02}}
    with (
        httpx.Client(base_url=router.url, timeout=10.0) as leaving,
        leaving.stream("POST", "/v1/completions", json=body) as response,
    ):
        next(response.iter_bytes())  # then leaving the block closes the connection
    assert_idle(router)
    deadline = time.monotonic() + 3.0
    while any(httpx.get(s.url + "/stats").json()["in_flight"] for s in foreign_fleet):
        assert time.monotonic() < deadline, "the upstream request was not aborted"
        time.sleep(0.05)


def test_client_disconnect_before_the_answer_releases(
    client: httpx.Client, router: ServerProcess
) -> None:
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"prompt": "x", "x_test": {"delay": 0.8}}, timeout=0.2)
    assert_idle(router)


def test_worker_removed_mid_request(client: httpx.Client, router: ServerProcess) -> None:
    """The request a removal would have cut ends, with nothing held (with several
    processes too: its guard releases into the removed worker's slot)."""
    body = {"prompt": "x", "stream": True, "x_test": {"tokens": 10, "token_delay": 0.05}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        worker = response.headers["x-kvserve-worker"]
        chunks = response.iter_bytes()
        next(chunks)
        workers = client.get("/workers").json()["workers"]
        url = next(w["url"] for w in workers if w["id"] == worker)
        removed = client.delete(f"/workers/{worker}")
        assert removed.status_code == 200
        assert held(router)[GAUGES[0]][worker] == 1
        assert b"[DONE]" in b"".join(chunks)
    assert_idle(router)
    assert worker not in {w["id"] for w in client.get("/workers").json()["workers"]}
    for _ in range(4):
        assert (
            client.post("/v1/completions", json={"prompt": "y"}).headers["x-kvserve-worker"]
            != worker
        )
    readded = client.post("/workers", json={"url": url})
    assert readded.status_code == 201 and readded.json()["healthy"] is True


def test_many_concurrent_requests_on_every_path(
    client: httpx.Client, router: ServerProcess
) -> None:
    bodies = [
        {"prompt": "ok"},
        {"prompt": "ok", "stream": True, "x_test": {"tokens": 5, "token_delay": 0.01}},
        {"prompt": "bad", "x_test": {"status": 400}},
        {"prompt": "flaky", "x_test": {"status": 500}},
        {"prompt": "slow", "x_test": {"delay": 2}},
    ] * 8

    def send(body: dict) -> int:
        return httpx.post(router.url + "/v1/completions", json=body, timeout=10.0).status_code

    with ThreadPoolExecutor(20) as pool:
        statuses = list(pool.map(send, bodies))
    assert sorted(set(statuses)) == [200, 400, 500, 504]
