"""The KV event subscriber follows a worker through a crash and a restart on the same
address: the new process has an empty cache and a new event log, so the subscriber must
drop what the old one held and continue from the new one's snapshot."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from kvserve.core.routing.kv_index import KVBlockIndex
from kvserve.router.config import CircuitBreakerConfig
from kvserve.router.kv_event_subscriber import KVEventSubscriber
from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess, free_port
from kvserve.router.prompt_tokens import PromptHasher
from kvserve.router.worker_registry import WorkerRegistry

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("kv-restart-model"), "llama")


def start_sim_worker(model_dir: Path, port: int) -> ServerProcess:
    args = [
        *KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port),
        "--runner", "sim", "--sim-profile", "tiny", "--num-blocks", "256",
        "--block-size", str(BLOCK), "--served-model-name", str(model_dir),
    ]  # fmt: skip
    return ServerProcess(args, f"http://127.0.0.1:{port}", name="sim-worker").wait_healthy(90)


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
    index = KVBlockIndex()
    restarted: ServerProcess | None = None
    try:
        async with aiohttp.ClientSession() as session:
            subscriber = KVEventSubscriber(
                index, registry, session, poll_timeout_s=1.0, retry_s=0.1, reconcile_s=0.2
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
