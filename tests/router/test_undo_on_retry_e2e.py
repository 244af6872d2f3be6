"""A failed attempt takes back what its routing decision recorded: a worker that answered
503 is not remembered as holding the prompt it never computed, so the prompt's next turns
go to the worker that did compute it (cache_aware's tree through the real router). A
worker that fails after sending a non-streamed answer's first-token headers is retried
like one that answered 503, and nothing stays held."""

from __future__ import annotations

import httpx

from kvserve.router.ports import free_port
from tests.support.metrics_text import by_label, samples
from tests.support.processes import start_foreign_server, start_router

RETRIES = "kvserve_router_retries_total"


def test_a_retried_prompt_is_remembered_only_where_it_was_computed() -> None:
    failing = start_foreign_server("A", free_port())
    healthy = start_foreign_server("B", free_port())
    options = ["--policy", "cache_aware", "--max-retries", "2", "--retry-initial-backoff", "0.01"]
    router = start_router([failing.url, healthy.url], free_port(), *options)
    client = httpx.Client(base_url=router.url, timeout=10.0)
    history = "a long shared history of the voyage. " * 20
    prompts = [f"conversation {i}: {history}" for i in range(8)]
    try:
        assert httpx.post(failing.url + "/admin/behavior", json={"status": 503}).status_code == 200
        for prompt in prompts:  # misses alternate between the two; A's are retried on B
            response = client.post("/v1/completions", json={"prompt": prompt})
            assert response.status_code == 200
            assert response.json()["system_fingerprint"] == "B"
        retried = sum(by_label(samples(router.url + "/metrics"), RETRIES, "worker").values())
        assert retried >= 2  # some of them did go to A first
        httpx.post(failing.url + "/admin/behavior", json={"status": 0})
        for prompt in prompts:  # next turns: only B ever computed these prefixes
            response = client.post("/v1/completions", json={"prompt": prompt + " and then?"})
            assert response.status_code == 200
            assert "reason=cache_hit" in response.headers["x-kvserve-decision"]
            assert response.json()["system_fingerprint"] == "B", prompt[:16]
    finally:
        client.close()
        for process in (router, failing, healthy):
            process.stop()


IN_FLIGHT = "kvserve_router_in_flight_requests"
PREFILL = "kvserve_router_in_flight_prefill_tokens"


def test_a_failure_after_the_first_token_headers_is_retried_and_releases_all() -> None:
    failing = start_foreign_server("A", free_port())
    healthy = start_foreign_server("B", free_port())
    options = ["--policy", "round_robin", "--max-retries", "2", "--retry-initial-backoff", "0.01"]
    router = start_router([failing.url, healthy.url], free_port(), *options)
    behavior = {"fail_after_first_token": True}
    try:
        assert httpx.post(failing.url + "/admin/behavior", json=behavior).status_code == 200
        for i in range(4):  # round robin: about half start on A, are retried on B
            response = httpx.post(router.url + "/v1/completions", json={"prompt": f"q{i}"})
            assert response.status_code == 200, response.text
            assert response.json()["system_fingerprint"] == "B"
        metrics = samples(router.url + "/metrics")
        assert sum(by_label(metrics, RETRIES, "worker").values()) >= 1
        for gauge in (IN_FLIGHT, PREFILL):
            assert set(by_label(metrics, gauge, "worker").values()) <= {0.0}
        httpx.post(healthy.url + "/admin/behavior", json=behavior)  # nowhere left to go
        refused = httpx.post(router.url + "/v1/completions", json={"prompt": "last"})
        assert refused.status_code == 503 and "error" in refused.json()
    finally:
        for process in (router, failing, healthy):
            process.stop()
