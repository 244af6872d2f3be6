"""A failed attempt takes back what its routing decision recorded: a worker that answered
503 is not remembered as holding the prompt it never computed, so the prompt's next turns
go to the worker that did compute it (cache_aware's tree through the real router)."""

from __future__ import annotations

import httpx

from tests.support.metrics_text import by_label, samples
from tests.support.ports import free_port
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
