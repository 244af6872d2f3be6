"""Two real worker processes sharing one storage tier (a directory, a redis-server).

Worker A serves a prompt and writes its blocks; worker B, which never saw it, serves a
prompt with the same long prefix: it reports the prefix as cached and answers exactly
what a cold engine answers. Both ledgers check out afterwards, and B's metrics count
the storage hits.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import redis

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from tests.support import redis_server as redis_support
from tests.support.ledger_check import ledger_check
from tests.support.metrics_text import samples
from tests.worker.worker_process import AUTH, start_worker

redis_server = redis_support.redis_server

PREFIX = [(13 * i) % 900 + 5 for i in range(192)]  # 12 blocks of 16
FIRST, SECOND = [*PREFIX, 71, 72, 73], [*PREFIX, 81, 82]


def _complete(url: str, model: str, prompt: list[int]) -> tuple[str, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, "logprobs": None}  # fmt: skip
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60.0)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
    return data["choices"][0]["text"], cached


def _cold_text(model_dir: Path, prompt: list[int]) -> str:
    engine = LLMEngine(model_dir, num_blocks=64, device="cpu")
    engine.add_request("cold", prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                       ignore_eos=True))  # fmt: skip
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            text += output.new_text
    return text


def _wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_worker_b_loads_what_worker_a_stored(
    tiny_model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest, backend: str
) -> None:
    if backend == "file":
        spec = f"file:{tmp_path / 'kv'}"
        stored = lambda: len(list((tmp_path / "kv").rglob("*.kvb")))  # noqa: E731
    else:
        server = request.getfixturevalue("redis_server")
        spec = server.url
        client = redis.Redis(port=server.port)
        stored = client.dbsize
    options = ("--kv-storage", spec, "--host-cache-blocks", "64")
    worker_a = start_worker(tiny_model_dir, *options)
    worker_b = start_worker(tiny_model_dir, *options)
    try:
        model = tiny_model_dir.name
        _complete(worker_a.url, model, FIRST)
        _wait_until(lambda: stored() >= 12)
        text, cached = _complete(worker_b.url, model, SECOND)
        assert text and (text, cached) == (_cold_text(tiny_model_dir, SECOND), 192)
        for worker in (worker_a, worker_b):
            assert ledger_check(worker.url, AUTH) == {"ok": True}
        metrics = samples(f"{worker_b.url}/metrics", AUTH)
        assert metrics[("kvserve_kv_tier_storage_hit_tokens_total", frozenset())] == 192
        assert metrics[("kvserve_kv_tier_host_capacity_blocks", frozenset())] == 64
    finally:
        for worker in (worker_a, worker_b):
            assert worker.stop(timeout_s=30) == 0, worker.log_tail()
