"""A real router process following foreign workers' KV events on ZMQ: sources given with
``--kv-events`` (paired by position) or with ``POST /workers``, blocks learned from a
publisher in vLLM's format that the test drives, and a prompt sent where its prefix is
held. Malformed sources are refused with OpenAI's error body."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.router.ports import free_port
from tests.support.processes import ServerProcess, router_processes, start_router
from tests.support.vllm_publisher import VllmFormatPublisher, block_stored

BS = 32


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("foreign-events-model"), "llama")


def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


@pytest.fixture
def publishers() -> Iterator[list[VllmFormatPublisher]]:
    started = [VllmFormatPublisher(free_port(), free_port()) for _ in range(2)]
    yield started
    for publisher in started:
        publisher.close()


def source(publisher: VllmFormatPublisher) -> str:
    replay = publisher.replay_port
    return f"tcp://127.0.0.1:{publisher.port}?replay=tcp://127.0.0.1:{replay}"


def test_sources_by_flag_and_by_post_are_followed(
    foreign_fleet: list[ServerProcess],
    publishers: list[VllmFormatPublisher],
    tokenizer_dir: Path,
) -> None:
    options = ["--policy", "kv_aware", "--tokenizer", str(tokenizer_dir)]
    options += ["--kv-events", source(publishers[0])]
    with start_router([foreign_fleet[0].url], free_port(), *options) as router:
        http = httpx.Client(base_url=router.url, timeout=10)
        added = http.post(
            "/workers", json={"url": foreign_fleet[1].url, "kv_events": source(publishers[1])}
        )
        assert added.status_code == 201 and added.json()["kv_events"] == source(publishers[1])
        for publisher in publishers:  # each router follower (one per process) subscribed
            publisher.wait_for_subscriber(count=router_processes())

        # Worker w1 (added by POST) reports a 3-block prefix; its engine names are its own.
        prefix = list(range(200, 200 + 3 * BS))
        publishers[1].publish([block_stored([1, 2, 3], None, prefix, BS)])

        def learned() -> bool:  # by the process this client's connection reaches
            stream = http.get("/workers").json()["workers"][1].get("kv_events_stream")
            return stream is not None and bool(stream["next_seq"] == 1)

        until(learned, "the router applied w1's event")
        body = {"model": "foreign", "prompt": [*prefix, 7, 8], "max_tokens": 2}
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvserve-worker"] == "w1"
        decision = answer.headers["x-kvserve-decision"]
        assert "reason=cache_hit" in decision and float(decision.split("matched=")[1]) > 0.9


def test_malformed_sources_are_refused(foreign_fleet: list[ServerProcess]) -> None:
    with start_router([foreign_fleet[0].url], free_port(), "--policy", "kv_aware") as router:
        for kv_events in (
            "udp://127.0.0.1:5",
            "tcp://*:5557",  # the router connects: it needs a host
            "tcp://127.0.0.1:5?resend=tcp://127.0.0.1:6",
            5,
        ):
            answer = httpx.post(
                f"{router.url}/workers", json={"url": foreign_fleet[2].url, "kv_events": kv_events}
            )
            assert answer.status_code == 400, kv_events
            assert answer.json()["error"]["code"] == "bad_worker"
        assert len(httpx.get(f"{router.url}/workers").json()["workers"]) == 1
