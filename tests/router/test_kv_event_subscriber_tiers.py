"""A subscriber resyncing from a tiered worker's snapshot learns every tier: blocks the
worker's device cache evicted into host memory are in the index under host."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import httpx
import pytest

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.router.config import CircuitBreakerConfig
from kvserve.router.kv_event_subscriber import KVEventSubscriber
from kvserve.router.worker_registry import WorkerRegistry
from tests.worker.test_kv_events import complete
from tests.worker.test_kv_events_tiers import (
    FIRST,
    SECOND,
    events_of,
    stored_hashes,
    tiered_worker,
    wait_for_storage,
)
from tests.worker.worker_process import AUTH

STALE_HOST_BLOCK = 12345  # held by nothing the worker reports


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiered-model"), "llama")


async def test_resync_fills_every_tier_and_drops_stale_ones(
    model_dir: Path, tmp_path: Path
) -> None:
    worker = await asyncio.to_thread(tiered_worker, model_dir, tmp_path / "kv")
    try:
        await asyncio.to_thread(complete, worker, FIRST)
        first = stored_hashes(await asyncio.to_thread(events_of, worker), "device")
        await asyncio.to_thread(complete, worker, SECOND)
        await asyncio.to_thread(wait_for_storage, worker, 24)
        snapshot = httpx.get(f"{worker.url}/kv/snapshot", headers=AUTH).json()
        evicted = set(first) - {h for h, _ in snapshot["blocks"]}
        assert evicted, "the second prompt must evict the first from device"

        registry = WorkerRegistry(CircuitBreakerConfig())
        worker_id = registry.add(worker.url).worker_id
        policy = KvAwarePolicy(KvAwareConfig())
        index = policy.routing.index
        # What an earlier process of this worker held: the snapshot must replace it.
        policy.observe_events(worker_id, [KVEvent(1, "stored", "host", (STALE_HOST_BLOCK,))])
        async with aiohttp.ClientSession(headers=AUTH) as session:
            subscriber = KVEventSubscriber(policy, registry, session, poll_timeout_s=1.0)
            following = asyncio.create_task(subscriber.run_forever())
            try:
                deadline = time.monotonic() + 20.0
                while subscriber.last_seq.get(worker_id) != snapshot["last_seq"]:
                    assert time.monotonic() < deadline, "the subscriber never resynced"
                    await asyncio.sleep(0.05)
            finally:
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
        assert all(index.holds(worker_id, h, "host") for h in evicted)
        assert not any(index.holds(worker_id, h, "device") for h in evicted)
        assert not index.holds(worker_id, STALE_HOST_BLOCK, "host")
        for tier, blocks in [("device", snapshot["blocks"]), *snapshot["tiers"].items()]:
            assert index.num_blocks(worker_id, tier) == len(blocks), tier
        assert index.num_blocks(worker_id, "storage") == 24
    finally:
        assert worker.stop(timeout_s=30) == 0, worker.log_tail()
