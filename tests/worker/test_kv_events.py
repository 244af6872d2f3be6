"""The KV events stream and snapshot, as a router subscriber follows them."""

from __future__ import annotations

import threading
import time

import httpx

from kvserve.router.local_fleet import ServerProcess
from tests.worker.worker_process import AUTH, BLOCK_SIZE, api


def complete(worker: ServerProcess, prompt: list[int]) -> None:
    with api(worker) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        assert client.post("/v1/completions", json=body).status_code == 200


def replay(events: list[dict], held: set[int]) -> set[int]:
    """A subscriber's view: apply events in order to the set of held hashes."""
    for event in events:
        if event["kind"] == "stored":
            held |= set(event["block_hashes"])
        elif event["kind"] == "removed":
            held -= set(event["block_hashes"])
        else:
            held = set()
    return held


def test_events_follow_the_cache_and_agree_with_the_snapshot(worker: ServerProcess) -> None:
    start = httpx.get(f"{worker.url}/kv/snapshot", headers=AUTH).json()
    held = {block_hash for block_hash, _ in start["blocks"]}
    assert start["block_size"] == BLOCK_SIZE

    complete(worker, [11 + i % 50 for i in range(5 * BLOCK_SIZE + 3)])
    answer = httpx.get(
        f"{worker.url}/kv/events", headers=AUTH, params={"after": start["last_seq"]}
    ).json()
    events = answer["events"]
    assert [e["seq"] for e in events] == list(range(start["last_seq"] + 1, answer["last_seq"] + 1))
    stored = [e for e in events if e["kind"] == "stored"]
    assert sum(len(e["block_hashes"]) for e in stored) >= 5
    assert all(e["tier"] == "device" for e in events)

    snapshot = httpx.get(f"{worker.url}/kv/snapshot", headers=AUTH).json()
    assert snapshot["last_seq"] == answer["last_seq"]
    assert replay(events, held) == {block_hash for block_hash, _ in snapshot["blocks"]}


def test_long_poll_wakes_when_an_event_arrives(worker: ServerProcess) -> None:
    last_seq = httpx.get(f"{worker.url}/kv/snapshot", headers=AUTH).json()["last_seq"]
    timer = threading.Timer(0.5, complete, (worker, [900 + i % 7 for i in range(3 * BLOCK_SIZE)]))
    timer.start()
    started = time.monotonic()
    answer = httpx.get(
        f"{worker.url}/kv/events",
        headers=AUTH,
        params={"after": last_seq, "timeout": 20},
        timeout=30,
    ).json()
    waited = time.monotonic() - started
    timer.join()
    assert answer["events"]
    assert answer["events"][0]["seq"] == last_seq + 1
    assert 0.4 < waited < 15


def test_long_poll_times_out_empty(worker: ServerProcess) -> None:
    last_seq = httpx.get(f"{worker.url}/kv/snapshot", headers=AUTH).json()["last_seq"]
    started = time.monotonic()
    answer = httpx.get(
        f"{worker.url}/kv/events", headers=AUTH, params={"after": last_seq, "timeout": 0.3}
    )
    assert answer.json() == {"last_seq": last_seq, "events": []}
    assert time.monotonic() - started >= 0.3


def test_a_subscriber_ahead_of_the_log_is_told_to_resync(worker: ServerProcess) -> None:
    last_seq = httpx.get(f"{worker.url}/kv/snapshot", headers=AUTH).json()["last_seq"]
    response = httpx.get(f"{worker.url}/kv/events", headers=AUTH, params={"after": last_seq + 1000})
    assert response.status_code == 410
    assert response.json()["error"]["code"] == "kv_events_gap"
