"""Prometheus metrics reflect the requests the worker served."""

from __future__ import annotations

import re

import httpx

from kvserve.router.local_fleet import ServerProcess
from tests.worker.worker_process import api


def sample(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    assert match, f"{name} missing"
    return float(match.group(1))


def test_metrics_count_requests_tokens_and_cache_hits(worker: ServerProcess) -> None:
    before = httpx.get(f"{worker.url}/metrics").text
    prompt = [40 + i % 30 for i in range(64)]
    with api(worker) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for _ in range(2):
            body = {"model": model, "prompt": prompt, "max_tokens": 3, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
    after = httpx.get(f"{worker.url}/metrics").text

    def grew(name: str) -> float:
        return sample(after, name) - sample(before, name)

    assert grew("kvserve_time_to_first_token_seconds_count") == 2
    assert grew("kvserve_e2e_request_latency_seconds_count") == 2
    assert grew("kvserve_inter_token_latency_seconds_count") >= 2
    assert grew("kvserve_generation_tokens_total") == 6
    assert grew("kvserve_prompt_tokens_total") == 128
    assert grew("kvserve_prefix_cache_hit_tokens_total") >= 48
    assert grew("kvserve_prefix_cache_queried_tokens_total") >= 64
    for gauge in (
        "kvserve_num_requests_running",
        "kvserve_num_requests_waiting",
        "kvserve_kv_blocks_used",
        "kvserve_kv_blocks_free",
        "kvserve_kv_blocks_cached",
        "kvserve_num_preemptions_total",
    ):
        assert sample(after, gauge) >= 0
