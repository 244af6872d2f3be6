"""kv_aware end to end: cost-model workers (real scheduler, cache, events, HTTP) behind the
router; the router's hashes match what the workers cache, and its choices follow them. The
event subscriber follows a worker through a crash and a restart on the same address."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.router.config import CircuitBreakerConfig
from kvserve.router.kv_event_subscriber import KVEventSubscriber
from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port
from kvserve.router.prompt_tokens import PromptHasher
from kvserve.router.worker_registry import WorkerRegistry
from tests.support.metrics_text import wait_until_indexed
from tests.support.processes import start_router

BLOCK = 16
SYSTEM = "You are a careful assistant. " * 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("kv-aware-model"), "llama")


def start_sim_worker(model_dir: Path, port: int | None = None) -> ServerProcess:
    port = port or free_port()
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
    wait_until_indexed(router.url, holder)  # the holder's own events reached the router
    time.sleep(2.5)  # a timer, not a sync: the speculative TTL (2 s) has lapsed after it
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


async def complete(session: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


async def snapshot(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/kv/snapshot") as response:
        return await response.json()


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.05)


async def test_subscriber_resyncs_from_a_restarted_workers_snapshot(model_dir: Path) -> None:
    """The new process has an empty cache and a new event log: the subscriber must drop
    what the old one held and continue from the new one's snapshot."""
    model = str(model_dir)
    hasher = PromptHasher(model_dir)
    before = {"model": model, "max_tokens": 2, "prompt": "Rivers and bridges in winter. " * 6}
    after = {"model": model, "max_tokens": 2, "prompt": "Gardens under summer light. " * 6}
    before_blocks, after_blocks = (hasher.blocks(b, BLOCK) for b in (before, after))
    assert before_blocks is not None and after_blocks is not None
    old_hashes, new_hashes = before_blocks.reusable_hashes, after_blocks.reusable_hashes
    assert len(old_hashes) >= 3 and not set(old_hashes) & set(new_hashes)

    port = free_port()
    worker = await asyncio.to_thread(start_sim_worker, model_dir, port)
    registry = WorkerRegistry(CircuitBreakerConfig())
    worker_id = registry.add(worker.url).worker_id
    policy = KvAwarePolicy(KvAwareConfig())
    index = policy.routing.index
    restarted: ServerProcess | None = None
    try:
        async with aiohttp.ClientSession() as session:
            subscriber = KVEventSubscriber(
                policy, registry, session, poll_timeout_s=1.0, retry_s=0.1, reconcile_s=0.2
            )
            following = asyncio.create_task(subscriber.run_forever())
            try:
                await complete(session, worker.url, before)
                await wait_until(
                    lambda: all(index.holds(worker_id, h) for h in old_hashes),
                    "the first worker's blocks reach the index through its events",
                )

                worker.kill()
                restarted = await asyncio.to_thread(start_sim_worker, model_dir, port)
                await complete(session, restarted.url, after)
                fresh = await snapshot(session, restarted.url)
                await wait_until(
                    lambda: (
                        subscriber.last_seq.get(worker_id) == fresh["last_seq"]
                        and all(index.holds(worker_id, h) for h in new_hashes)
                    ),
                    "the index follows the restarted worker's new log",
                )
            finally:
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
        assert not any(index.holds(worker_id, h) for h in old_hashes)  # gone with the crash
        assert index.num_blocks(worker_id) == len(fresh["blocks"])
    finally:
        for server in (worker, restarted):
            if server is not None:
                server.stop()


def test_salted_prompts_are_hashed_and_routed_as_the_workers_cache_them(
    fleet, model_dir: Path
) -> None:
    """Salts A, A, B through the router: the worker caches A's blocks under the hashes
    the router computes, the second A follows them and is served from them, and B
    matches nothing anywhere."""
    router, workers = fleet
    system = "Salted prompt about harbours, tides and the ships between them. " * 8

    def send(salt: str, question: str) -> tuple[dict, httpx.Response]:
        body = {"model": str(model_dir), "max_tokens": 2, "prompt": system + question}
        body["cache_salt"] = salt
        return body, httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)

    body, first = send("tenant-a", "first")
    holder = first.headers["x-kvserve-worker"]
    listed = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
    [url] = [w["url"] for w in listed if w["id"] == holder]
    [worker] = [w for w in workers if w.url == url]
    salted = PromptHasher(model_dir).blocks(body, BLOCK)
    unsalted = PromptHasher(model_dir).blocks({**body, "cache_salt": ""}, BLOCK)
    assert salted is not None and unsalted is not None and len(salted.reusable_hashes) >= 4
    held = snapshot_hashes(worker)
    assert set(salted.reusable_hashes) <= held
    assert not set(unsalted.reusable_hashes) & held
    wait_until_indexed(router.url, holder)
    _, again = send("tenant-a", "second")
    assert again.headers["x-kvserve-worker"] == holder, again.headers["x-kvserve-decision"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    _, other = send("tenant-b", "third")
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "reason=cache_hit" not in other.headers["x-kvserve-decision"]
