"""A kvserve worker's ``--kv-events-publisher`` read by a subscriber written from vLLM's
wire format alone (raw ZMQ and msgpack here, none of kvserve's decoding): BlockStored
chains start with the prompt's tokens and name the blocks the worker's snapshot lists,
sequence numbers run without gaps, and the replay socket gives the same batches again.
Then a kvserve router follows two such workers over ZMQ and routes a shared prefix to
the worker that holds it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port
from tests.support.metrics_text import samples
from tests.support.processes import start_router

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("publisher-model"), "llama")


class PublishingWorker:
    def __init__(self, model_dir: Path) -> None:
        self.events_port, self.replay_port = free_port(), free_port()
        port = free_port()
        args = [
            *KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port),
            "--runner", "sim", "--sim-profile", "tiny", "--num-blocks", "256",
            "--block-size", str(BLOCK), "--served-model-name", str(model_dir),
            "--kv-events-publisher", f"tcp://*:{self.events_port}",
            "--kv-events-replay", f"tcp://*:{self.replay_port}",
        ]  # fmt: skip
        self.server = ServerProcess(args, f"http://127.0.0.1:{port}", name="publishing-worker")
        self.server.wait_healthy(90)
        self.url = self.server.url

    def source(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}?replay=tcp://127.0.0.1:{self.replay_port}"


@pytest.fixture(scope="module")
def workers(model_dir: Path) -> Iterator[list[PublishingWorker]]:
    started: list[PublishingWorker] = []
    try:
        started = [PublishingWorker(model_dir) for _ in range(2)]
        yield started
    finally:
        for worker in started:
            worker.server.stop()


def complete(url: str, model_dir: Path, tokens: list[int]) -> dict[str, Any]:
    body = {"model": str(model_dir), "prompt": tokens, "max_tokens": 2}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def receive(sub: zmq.Socket[bytes], timeout_s: float) -> list[bytes] | None:
    if not sub.poll(int(timeout_s * 1000)):
        return None
    return list(sub.recv_multipart())


def decode(frames: list[bytes]) -> tuple[int, list[dict[str, Any]]]:
    """vLLM's format: topic, 8-byte big-endian seq, msgpack [ts, [event maps], rank]."""
    assert len(frames) == 3 and frames[0] == b"kv" and len(frames[1]) == 8
    ts, events, rank = msgpack.unpackb(frames[2])
    assert isinstance(ts, float) and rank == 0
    return int.from_bytes(frames[1], "big"), events


def test_events_decoded_from_the_format_alone(
    workers: list[PublishingWorker], model_dir: Path
) -> None:
    worker = workers[0]
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{worker.events_port}")
    try:
        # A SUB misses what is published before its subscription arrives: warm up with
        # prompts of their own until one is heard.
        deadline = time.monotonic() + 30
        warm = 0
        while receive(sub, 0.2) is None:
            assert time.monotonic() < deadline, "no KV event reached the subscriber"
            warm += 1
            complete(worker.url, model_dir, [10 + warm % 80] * (BLOCK + 1))
        while receive(sub, 0.5) is not None:
            pass  # the warm-up's remaining batches

        prompt = list(range(100, 100 + 3 * BLOCK + 5))
        complete(worker.url, model_dir, prompt)
        batches: list[tuple[int, list[dict[str, Any]]]] = []
        while (frames := receive(sub, 1.0)) is not None:
            batches.append(decode(frames))
        assert batches
        seqs = [seq for seq, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap

        stored = [e for _, events in batches for e in events if e["type"] == "BlockStored"]
        first = stored[0]
        assert first["parent_block_hash"] is None and first["block_size"] == BLOCK
        assert first["medium"] == "GPU"
        assert first["token_ids"] == prompt[: len(first["token_ids"])]
        chain = [h for e in stored for h in e["block_hashes"]]
        tokens = [t for e in stored for t in e["token_ids"]]
        assert tokens[: 3 * BLOCK] == prompt[: 3 * BLOCK]
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in chain)
        snapshot = httpx.get(f"{worker.url}/kv/snapshot").json()["blocks"]
        assert set(chain) <= {block_hash for block_hash, _ in snapshot}

        # The replay socket gives every batch again, then its end marker.
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{worker.replay_port}")
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = []
        while True:
            frames = receive(dealer, 5.0)
            assert frames is not None, "the replay did not finish"
            assert frames[0] == b""
            if frames[2] == b"\xff" * 8:
                break
            replayed.append(decode(frames[1:]))
        dealer.close(linger=0)
        assert replayed[: len(batches)] == batches
    finally:
        sub.close(linger=0)
        context.term()


def test_router_follows_kvserve_workers_over_zmq(
    workers: list[PublishingWorker], model_dir: Path
) -> None:
    router = start_router(
        [w.url for w in workers], free_port(), "--policy", "kv_aware",
        "--kv-events", *[w.source() for w in workers],
    )  # fmt: skip
    try:
        listed = httpx.get(f"{router.url}/workers").json()["workers"]
        assert [w["kv_events"] for w in listed] == [w.source() for w in workers]
        # Cache a long prefix on worker 1 directly: only its events can tell the router.
        prefix = list(range(300, 300 + 8 * BLOCK))
        complete(workers[1].url, model_dir, [*prefix, 1])
        holder = listed[1]["id"]
        deadline = time.monotonic() + 30
        while True:
            labels = frozenset({("worker", holder), ("tier", "device")})
            held = samples(f"{router.url}/metrics").get(("kvserve_router_kv_index_blocks", labels))
            if held is not None and held >= 8:
                break
            assert time.monotonic() < deadline, "the router never learned worker 1's blocks"
            time.sleep(0.05)
        body = {"model": str(model_dir), "prompt": [*prefix, 2], "max_tokens": 2}
        answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200
        assert answer.headers["x-kvserve-worker"] == holder
        assert "reason=cache_hit" in answer.headers["x-kvserve-decision"]
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8 * BLOCK
    finally:
        router.stop()


def test_a_taken_publisher_port_fails_the_start(model_dir: Path) -> None:
    context = zmq.Context()
    squatter = context.socket(zmq.PUB)
    port = free_port()
    squatter.bind(f"tcp://127.0.0.1:{port}")
    try:
        args = [
            *KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(free_port()),
            "--runner", "sim", "--sim-profile", "tiny", "--num-blocks", "64",
            "--kv-events-publisher", f"tcp://*:{port}",
        ]  # fmt: skip
        worker = ServerProcess(args, "http://127.0.0.1:1", name="port-taken-worker")
        try:
            assert worker.process.wait(90) != 0
        finally:
            worker.stop()
        assert "Address already in use" in worker.log_path.read_text()
    finally:
        squatter.close(linger=0)
        context.term()
