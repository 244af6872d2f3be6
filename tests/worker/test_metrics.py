"""Prometheus metrics reflect the requests the worker served."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvserve.router.local_fleet import ServerProcess
from tests.worker.worker_process import AUTH, BLOCK_SIZE, api, start_worker


def sample(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    assert match, f"{name} missing"
    return float(match.group(1))


def test_metrics_count_requests_tokens_and_cache_hits(worker: ServerProcess) -> None:
    before = httpx.get(f"{worker.url}/metrics", headers=AUTH).text
    prompt = [40 + i % 30 for i in range(64)]
    with api(worker) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for _ in range(2):
            body = {"model": model, "prompt": prompt, "max_tokens": 3, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
    after = httpx.get(f"{worker.url}/metrics", headers=AUTH).text

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
        "kvserve_engine_wait_changes_total",
    ):
        assert sample(after, gauge) >= 0
    assert sample(after, "kvserve_engine_threads") >= 1
    assert sample(after, "kvserve_engine_short_waits") in (0, 1)


def test_prefix_cache_metrics_count_each_request_once_as_its_usage_reports(
    tiny_model_dir: Path,
) -> None:
    """On a pool too small for two requests at once, the second one matches its cached
    prefix at every step it waits for room; the metrics still count it once, with the
    cached tokens its usage reports (the numbers the scheduler decided)."""
    worker = start_worker(tiny_model_dir, "--num-blocks", "10")
    shared = [300 + i for i in range(3 * BLOCK_SIZE)]
    # 4 blocks at admission, 7 by its end: all the free pool, the shared 3 stay cached.
    long_running = [500 + i for i in range(4 * BLOCK_SIZE)]
    waiting = [*shared, *(700 + i for i in range(2 * BLOCK_SIZE + 8))]  # needs 3 new blocks
    try:
        before = httpx.get(f"{worker.url}/metrics", headers=AUTH).text
        with api(worker) as client, ThreadPoolExecutor(1) as pool:
            model = client.get("/v1/models").json()["data"][0]["id"]

            def body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
                return {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                        "ignore_eos": True}  # fmt: skip

            def usage(prompt: list[int]) -> dict[str, Any]:
                response = client.post("/v1/completions", json=body(prompt, 1))
                assert response.status_code == 200, response.text
                return response.json()["usage"]

            usages = [usage(shared)]  # commits the 3 shared blocks
            streamed = {
                **body(long_running, 3 * BLOCK_SIZE),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with client.stream("POST", "/v1/completions", json=streamed) as response:
                events = (line for line in response.iter_lines() if line.startswith("data: {"))
                first = next(events)  # the long request runs: the next one must wait
                waiter = pool.submit(usage, waiting)
                last = [first, *events][-1]
            usages += [json.loads(last.removeprefix("data: "))["usage"], waiter.result()]
        after = httpx.get(f"{worker.url}/metrics", headers=AUTH).text
    finally:
        assert worker.stop(timeout_s=30) == 0, worker.log_tail()

    def grew(name: str) -> float:
        return sample(after, name) - sample(before, name)

    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached == [0, 0, 3 * BLOCK_SIZE]
    assert grew("kvserve_prefix_cache_hit_tokens_total") == sum(cached)
    prompt_tokens = [u["prompt_tokens"] for u in usages]
    assert prompt_tokens == [len(shared), len(long_running), len(waiting)]
    assert grew("kvserve_prefix_cache_queried_tokens_total") == sum(prompt_tokens)
