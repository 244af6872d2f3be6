"""The snapshot covers every tier: a worker whose device cache evicted a prompt's blocks
still lists them under host, and its storage tier is what its events announced."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.router.local_fleet import ServerProcess
from tests.worker.test_kv_events import complete, replay
from tests.worker.worker_process import AUTH, start_worker

# 12 full blocks each; a device pool of 16 blocks cannot hold both.
FIRST = [(13 * i) % 900 + 5 for i in range(193)]
SECOND = [(29 * i) % 900 + 7 for i in range(193)]


def tiered_worker(model_dir: Path, storage_dir: Path) -> ServerProcess:
    """A worker with a device pool too small for two prompts, a host tier and storage."""
    options = ("--num-blocks", "16", "--host-cache-blocks", "64")
    return start_worker(model_dir, *options, "--kv-storage", f"file:{storage_dir}")


def replay_tier(events: list[dict], tier: str) -> set[int]:
    return replay([event for event in events if event["tier"] == tier], set())


def stored_hashes(events: list[dict], tier: str) -> list[int]:
    return [
        h for e in events if e["tier"] == tier and e["kind"] == "stored" for h in e["block_hashes"]
    ]


def wait_for_storage(worker: ServerProcess, num_blocks: int) -> None:
    """Completed writes are announced before an engine step: an idle engine needs a
    request (too short to fill a block) to take one."""
    deadline = time.monotonic() + 30.0
    while len(replay_tier(events_of(worker), "storage")) < num_blocks:
        assert time.monotonic() < deadline, "storage writes were never announced"
        time.sleep(0.05)
        complete(worker, [1, 2, 3])


def events_of(worker: ServerProcess) -> list[dict]:
    return httpx.get(f"{worker.url}/kv/events", headers=AUTH).json()["events"]


@pytest.fixture(scope="module")
def worker(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = tiered_worker(tiny_model_dir, tmp_path_factory.mktemp("kv-store"))
    yield server
    assert server.stop(timeout_s=30) == 0, server.log_tail()


def test_snapshot_lists_blocks_evicted_into_host(worker: ServerProcess) -> None:
    complete(worker, FIRST)
    first = stored_hashes(events_of(worker), "device")
    complete(worker, SECOND)
    wait_for_storage(worker, 24)
    snapshot = httpx.get(f"{worker.url}/kv/snapshot", headers=AUTH).json()
    events = httpx.get(f"{worker.url}/kv/events", headers=AUTH).json()
    assert snapshot["last_seq"] == events["last_seq"]

    device = {h for h, _ in snapshot["blocks"]}
    host = {h for h, _ in snapshot["tiers"]["host"]}
    evicted = [h for h in first if h not in device]
    assert len(first) == 12 and evicted, "the second prompt must evict the first from device"
    assert set(evicted) <= host
    assert set(first) <= host
    for tier, listed in [("device", device), ("host", host)]:
        assert listed == replay_tier(events["events"], tier)
    storage = snapshot["tiers"]["storage"]
    assert {h for h, _ in storage} == replay_tier(events["events"], "storage")
    assert len(storage) == 24


def test_host_snapshot_lists_parents_first(worker: ServerProcess) -> None:
    snapshot = httpx.get(f"{worker.url}/kv/snapshot", headers=AUTH).json()
    seen: set[int | None] = {None}
    for block_hash, parent in snapshot["tiers"]["host"]:
        assert parent in seen
        seen.add(block_hash)
    assert len(seen) > 1


def test_a_worker_without_lower_tiers_lists_none(tiny_model_dir: Path) -> None:
    server = start_worker(tiny_model_dir)
    try:
        assert httpx.get(f"{server.url}/kv/snapshot", headers=AUTH).json()["tiers"] == {}
    finally:
        assert server.stop(timeout_s=30) == 0, server.log_tail()
