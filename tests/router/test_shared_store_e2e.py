"""Workers sharing a KV store, followed by a real subscriber: a block one of them wrote is
credited to every worker of that store (not only its writer), a worker of another store
gets none of it, kv_aware sends the prompt to an idle member instead of the busy writer,
and that member really loads it from the store."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import httpx

from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.types import WorkerLoad
from kvserve.router.config import CircuitBreakerConfig
from kvserve.router.kv_event_subscriber import KVEventSubscriber
from kvserve.router.local_fleet import ServerProcess
from kvserve.router.worker_registry import WorkerRegistry
from tests.worker.test_kv_events import complete
from tests.worker.test_kv_events_tiers import FIRST, events_of, stored_hashes, wait_for_storage
from tests.worker.worker_process import AUTH, BLOCK_SIZE, start_worker

FULL_BLOCKS = len(FIRST) // BLOCK_SIZE


def storage_hit_tokens(worker: ServerProcess) -> float:
    text = httpx.get(f"{worker.url}/metrics", headers=AUTH).text
    lines = [line for line in text.splitlines() if line.startswith("kvserve_kv_tier_storage_hit")]
    return sum(float(line.split()[-1]) for line in lines)


async def test_a_stored_block_is_credited_to_every_worker_of_its_store(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    stores = [tmp_path / "shared", tmp_path / "shared", tmp_path / "other"]
    workers: list[ServerProcess] = []
    try:
        # one at a time: workers started together may be handed the same free port
        for directory in stores:
            workers.append(start_worker(tiny_model_dir, "--kv-storage", f"file:{directory}"))
        writer, member, _ = workers
        await asyncio.to_thread(complete, writer, FIRST)
        await asyncio.to_thread(wait_for_storage, writer, FULL_BLOCKS)
        hashes = stored_hashes(await asyncio.to_thread(events_of, writer), "device")[:FULL_BLOCKS]
        names = [
            httpx.get(f"{w.url}/kv/snapshot", headers=AUTH).json()["storage_id"] for w in workers
        ]
        assert names[0] == names[1] != names[2]

        registry = WorkerRegistry(CircuitBreakerConfig())
        ids = [registry.add(w.url).worker_id for w in workers]
        policy = KvAwarePolicy(KvAwareConfig())
        index = policy.routing.index
        async with aiohttp.ClientSession(headers=AUTH) as session:
            subscriber = KVEventSubscriber(policy, registry, session, poll_timeout_s=1.0)
            following = asyncio.create_task(subscriber.run_forever())
            try:
                deadline = time.monotonic() + 20.0
                while index.num_blocks(ids[0], "storage") < FULL_BLOCKS or not all(
                    w in subscriber.last_seq for w in ids
                ):
                    assert time.monotonic() < deadline, "the subscriber never caught up"
                    await asyncio.sleep(0.05)
            finally:
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
        assert [index.store_of(w) for w in ids] == names
        matches = index.match(hashes, ids, now=time.monotonic())
        assert matches[ids[0]].blocks_by_tier["device"] == FULL_BLOCKS
        assert matches[ids[1]].blocks_by_tier == {"device": 0, "host": 0, "storage": FULL_BLOCKS}
        assert matches[ids[2]].num_blocks == 0

        busy = WorkerLoad(ids[0], in_flight_requests=4, in_flight_prefill_tokens=100_000)
        loads = [busy, WorkerLoad(ids[1]), WorkerLoad(ids[2])]
        choice = policy.routing.best(loads, hashes, len(FIRST), BLOCK_SIZE, time.monotonic())
        assert (choice.worker_id, choice.reason) == (ids[1], "cache_hit")
        assert choice.prediction.cached_tokens == FULL_BLOCKS * BLOCK_SIZE

        await asyncio.to_thread(complete, member, FIRST)
        assert storage_hit_tokens(member) == FULL_BLOCKS * BLOCK_SIZE
    finally:
        for worker in workers:
            assert worker.stop(timeout_s=30) == 0, worker.log_tail()
