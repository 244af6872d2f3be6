"""A worker killed mid-run: its stream ends, it is marked unhealthy and skipped, nothing
hangs, and it is readmitted when it comes back on the same address (with one router
process and with two: each process checks health itself)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from kvserve.router.ports import free_port
from tests.support.metrics_text import by_label, samples
from tests.support.processes import start_foreign_server, start_router

RETRIES = "kvserve_router_retries_total"
IN_FLIGHT = "kvserve_router_in_flight_requests"


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _retries(router_url: str) -> dict[str, float]:
    """Retries per worker (with several processes, a scrape sums them all)."""
    return by_label(samples(router_url + "/metrics"), RETRIES, "worker")


@pytest.mark.parametrize("processes", [1, 2])
def test_killed_worker_is_skipped_then_readmitted(processes: int) -> None:
    survivor = start_foreign_server("A", free_port())
    victim_port = free_port()
    victim = start_foreign_server("B", victim_port)
    options = ["--policy", "round_robin", "--max-retries", "2", "--retry-initial-backoff", "0.01"]
    options += ["--health-check-interval", "0.2", "--health-check-timeout", "0.5"]
    options += ["--health-failure-threshold", "2", "--health-success-threshold", "2"]
    options += ["--processes", str(processes)]
    router = start_router([survivor.url, victim.url], free_port(), *options)
    client = httpx.Client(base_url=router.url, timeout=5.0)  # one connection: one process

    def victim_healthy() -> bool:
        return client.get("/workers").json()["workers"][1]["healthy"]

    try:
        first = client.post("/v1/completions", json={"prompt": "a"})
        assert first.headers["x-kvserve-worker"] == "w0"
        body = {"prompt": "b", "stream": True, "x_test": {"tokens": 100, "token_delay": 0.05}}
        started = time.monotonic()
        with client.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.headers["x-kvserve-worker"] == "w1"
            chunks = stream.iter_bytes()
            next(chunks)
            victim.kill()
            rest = b"".join(chunks)
        assert b"stream_broken" in rest and time.monotonic() - started < 4.0

        for i in range(6):  # before the health check notices: retried on the survivor
            response = client.post("/v1/completions", json={"prompt": f"during {i}"})
            assert response.status_code == 200
            assert response.json()["system_fingerprint"] == "A"
        _wait_for(lambda: victim_healthy() is False, 3.0, "the dead worker is unhealthy")
        retries_before = _retries(router.url)
        for i in range(4):
            response = client.post("/v1/completions", json={"prompt": f"after {i}"})
            assert response.headers["x-kvserve-worker"] == "w0"
        assert _retries(router.url) == retries_before  # skipped, not retried

        victim = start_foreign_server("B", victim_port)
        _wait_for(lambda: victim_healthy() is True, 3.0, "the worker is readmitted")
        answers = [client.post("/v1/completions", json={"prompt": f"back {i}"}) for i in range(4)]
        assert {a.json()["system_fingerprint"] for a in answers} == {"A", "B"}
        held = by_label(samples(router.url + "/metrics"), IN_FLIGHT, "worker")
        assert set(held.values()) == {0.0}
    finally:
        client.close()
        for process in (router, survivor, victim):
            process.stop()


def test_a_worker_started_after_the_router_takes_traffic_within_seconds() -> None:
    """With the default 60 s health interval, a worker still loading when the router
    started must not wait for two more full intervals."""
    late_port = free_port()
    router = start_router(
        [f"http://127.0.0.1:{late_port}"], free_port(), "--policy", "round_robin",
        ready_path="/metrics",
    )  # fmt: skip
    late = None
    try:
        with httpx.Client(base_url=router.url, timeout=5.0) as client:
            assert client.get("/workers").json()["workers"][0]["healthy"] is False
            late = start_foreign_server("L", late_port)
            _wait_for(
                lambda: client.get("/workers").json()["workers"][0]["healthy"], 3.0, "it is used"
            )
            assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 200
    finally:
        for process in (router, late):
            if process is not None:
                process.stop()
