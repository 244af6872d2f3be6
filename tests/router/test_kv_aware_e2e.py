"""kv_aware end to end: cost-model workers (real scheduler, cache, events, HTTP) behind the
router; the router's hashes match what the workers cache, and its choices follow them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess, free_port
from kvserve.router.prompt_tokens import PromptHasher
from tests.support.processes import start_router

BLOCK = 16
SYSTEM = "You are a careful assistant. " * 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("kv-aware-model"), "llama")


def start_sim_worker(model_dir: Path) -> ServerProcess:
    port = free_port()
    args = [
        *KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port),
        "--runner", "sim", "--sim-profile", "tiny", "--num-blocks", "256",
        "--block-size", str(BLOCK), "--served-model-name", str(model_dir),
    ]  # fmt: skip
    return ServerProcess(args, f"http://127.0.0.1:{port}", name="sim-worker").wait_healthy(90)


@pytest.fixture(scope="module")
def fleet(model_dir: Path) -> Iterator[tuple[ServerProcess, list[ServerProcess]]]:
    workers: list[ServerProcess] = []
    router = None
    try:
        workers = [start_sim_worker(model_dir) for _ in range(3)]
        router = start_router([w.url for w in workers], free_port(), "--policy", "kv_aware")
        yield router, workers
    finally:
        for server in [router, *workers]:
            if server is not None:
                server.stop()


def chat(model: str, user: str) -> dict:
    return {
        "model": model,
        "max_tokens": 4,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    }


def snapshot_hashes(worker: ServerProcess) -> set[int]:
    blocks = httpx.get(f"{worker.url}/kv/snapshot").json()["blocks"]
    return {block_hash for block_hash, _ in blocks}


def test_router_and_worker_hash_a_chat_the_same(fleet, model_dir: Path) -> None:
    _, workers = fleet
    body = chat(str(model_dir), "Tell me about rivers and bridges in winter.")
    answer = httpx.post(f"{workers[0].url}/v1/chat/completions", json=body, timeout=30).json()
    assert answer["choices"][0]["message"]["content"]  # deterministic filler tokens
    blocks = PromptHasher(model_dir).blocks(body, BLOCK)
    assert blocks is not None and blocks.num_tokens == answer["usage"]["prompt_tokens"]
    assert len(blocks.reusable_hashes) >= 4
    assert set(blocks.reusable_hashes) <= snapshot_hashes(workers[0])


def test_second_turn_goes_to_the_holder_once_events_arrive(fleet, model_dir: Path) -> None:
    router, _ = fleet
    model = str(model_dir)
    first = httpx.post(
        f"{router.url}/v1/chat/completions",
        json=chat(model, "First question about trees."),
        timeout=30,
    )
    holder = first.headers["x-kvserve-worker"]
    time.sleep(2.5)  # past the speculative TTL: only the worker's events can tell now
    second = httpx.post(
        f"{router.url}/v1/chat/completions",
        json=chat(model, "Second question, on stones."),
        timeout=30,
    )
    decision = second.headers["x-kvserve-decision"]
    assert "policy=kv_aware" in decision and "reason=cache_hit" in decision, decision
    assert second.headers["x-kvserve-worker"] == holder
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt = second.json()["usage"]["prompt_tokens"]
    predicted = float(decision.split("matched=")[1]) * prompt
    assert cached > 0 and abs(predicted - cached) <= 1


def test_a_burst_sharing_a_new_prefix_follows_the_first(fleet, model_dir: Path) -> None:
    router, _ = fleet
    system = "Burst prompt about gardens and summer light. " * 10
    bodies = [
        {"model": str(model_dir), "max_tokens": 2, "prompt": system + f"item {i}"} for i in range(4)
    ]
    served = {
        httpx.post(f"{router.url}/v1/completions", json=b, timeout=30).headers["x-kvserve-worker"]
        for b in bodies
    }
    assert len(served) == 1


def test_removed_worker_gets_no_more_traffic(fleet, model_dir: Path) -> None:
    router, _ = fleet
    listed = httpx.get(f"{router.url}/workers").json()["workers"]
    victim = listed[0]["id"]
    assert httpx.delete(f"{router.url}/workers/{victim}").status_code == 200
    try:
        for i in range(6):
            body = chat(str(model_dir), f"Question number {i} about the river.")
            answer = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
            assert answer.status_code == 200 and answer.headers["x-kvserve-worker"] != victim
    finally:
        httpx.post(f"{router.url}/workers", json={"url": listed[0]["url"]})
