"""kvserve's router over a fleet of real vLLM servers (the CPU build in .venv-vllm), each
with prefix caching and ZMQ KV events: the router learns every worker's cache from its
events alone and routes a shared prefix to the worker that holds it, where vLLM's own
prefix-cache hit counter rises; events lost on the way are fetched from vLLM's replay
socket; a killed worker's blocks are dropped, and relearned once it is back; blocks vLLM
evicts from a full cache leave the router's index.

One module-scoped fleet (vLLM takes 20-150 s to start on a loaded 2-core box). The tests
fail, never skip, when vLLM is not set up (scripts/setup_vllm.sh).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvserve.router.local_fleet import ServerProcess
from kvserve.router.ports import free_port
from tests.support.lossy_zmq_link import LossyZmqLink
from tests.support.metrics_text import samples
from tests.support.processes import start_router
from tests.support.vllm_server import BLOCK_SIZE, VllmServer

pytestmark = pytest.mark.timeout(900)

KV_BLOCKS = 96  # each server's cache: small enough for a test to fill it
SYSTEM = "You are a patient assistant who answers questions about rivers and bridges. " * 6


@dataclass
class Fleet:
    model: str
    vllm: list[VllmServer]
    link: LossyZmqLink  # between vllm[0]'s publisher and the router
    router: ServerProcess

    def workers(self) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.router.url}/workers").json()["workers"])

    def stream(self, index: int) -> dict[str, Any]:
        return dict(self.workers()[index]["kv_events_stream"])

    def indexed_blocks(self, index: int) -> float:
        labels = frozenset({("worker", f"w{index}"), ("tier", "device")})
        found = samples(f"{self.router.url}/metrics")
        return found.get(("kvserve_router_kv_index_blocks", labels), 0.0)


def until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def prefix_hits(server: VllmServer) -> float:
    """vLLM's own count of prompt tokens served from its prefix cache."""
    return server.counters("vllm:prefix_cache_hits_total")["vllm:prefix_cache_hits_total"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from kvserve.engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path_factory.mktemp("vllm-model"), "qwen3")
    servers: list[VllmServer] = []
    link = router = None
    try:
        servers = [VllmServer(model_dir, kv_blocks=KV_BLOCKS) for _ in range(2)]  # start at once
        for server in servers:
            server.wait_healthy()
        link = LossyZmqLink(f"tcp://127.0.0.1:{servers[0].events_port}")
        lossy = f"{link.endpoint}?replay=tcp://127.0.0.1:{servers[0].replay_port}"
        router = start_router(
            [s.url for s in servers], free_port(), "--policy", "kv_aware",
            "--health-check-interval", "1", "--health-success-threshold", "1",
            "--kv-events", lossy, servers[1].kv_events(),
        )  # fmt: skip
        until(lambda: link.subscribers >= 1, "the router subscribed through the link")
        yield Fleet(str(model_dir), servers, link, router)
    finally:
        if router is not None:
            router.stop()
        if link is not None:
            link.close()
        for server in servers:
            server.stop()


def chat(fleet: Fleet, messages: list[dict[str, str]]) -> httpx.Response:
    body = {"model": fleet.model, "max_tokens": 4, "temperature": 0.0, "messages": messages}
    answer = httpx.post(f"{fleet.router.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer


def complete_direct(fleet: Fleet, server: VllmServer, prompt: str | list[int]) -> None:
    body = {"model": fleet.model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text


def worker_index(answer: httpx.Response) -> int:
    return int(answer.headers["x-kvserve-worker"].removeprefix("w"))


def test_a_conversation_goes_back_to_the_worker_that_holds_it(fleet: Fleet) -> None:
    first = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Why do rivers bend?"},
    ]
    answer = chat(fleet, first)
    holder = worker_index(answer)
    reply = answer.json()["choices"][0]["message"]["content"]
    prompt_tokens = answer.json()["usage"]["prompt_tokens"]
    # Past the router's own speculation: its events must have told it.
    until(
        lambda: fleet.indexed_blocks(holder) >= prompt_tokens // BLOCK_SIZE,
        "the holder's BlockStored events reached the router",
    )
    hits_before = prefix_hits(fleet.vllm[holder])
    follow_up = [{"role": "assistant", "content": reply}, {"role": "user", "content": "And lakes?"}]
    second = chat(fleet, [*first, *follow_up])
    assert worker_index(second) == holder
    decision = second.headers["x-kvserve-decision"]
    assert "policy=kv_aware" in decision and "reason=cache_hit" in decision, decision
    assert float(decision.split("matched=")[1]) > 0.5
    reused = prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert prefix_hits(fleet.vllm[holder]) >= hits_before + reused


def test_lost_events_are_fetched_from_the_replay_socket(fleet: Fleet) -> None:
    before = fleet.stream(0)
    forwarded = fleet.link.forwarded
    fleet.link.drop_next(1)  # the step that stores the next prompt's blocks
    lost = "Notes on the history of stone bridges in mountain valleys. " * 8
    complete_direct(fleet, fleet.vllm[0], lost)
    until(lambda: fleet.link.dropped >= 1, "the link lost a message")
    complete_direct(fleet, fleet.vllm[0], "An unrelated prompt about weather and clouds. " * 4)
    until(lambda: fleet.link.forwarded > forwarded, "a later message passed the link")
    until(lambda: fleet.stream(0)["replays"] > before["replays"], "the router replayed")
    stream = fleet.stream(0)
    assert stream["gaps"] > before["gaps"] and stream["drops"] == before["drops"]
    # The lost step's blocks came from the replay: the router knows worker 0 holds them.
    answer = httpx.post(
        f"{fleet.router.url}/v1/completions",
        json={"model": fleet.model, "prompt": lost + "More.", "max_tokens": 2},
        timeout=120,
    )
    assert answer.status_code == 200 and worker_index(answer) == 0
    assert "reason=cache_hit" in answer.headers["x-kvserve-decision"]


def test_a_restarted_worker_is_dropped_and_relearned(fleet: Fleet) -> None:
    server = fleet.vllm[1]
    text = "A long note about ferries, tides and harbour cranes at dawn. " * 8
    complete_direct(fleet, server, text)
    until(lambda: fleet.indexed_blocks(1) > 0, "worker 1's blocks were indexed")
    drops = fleet.stream(1)["drops"]
    server.kill()
    until(lambda: fleet.stream(1)["drops"] > drops, "the router dropped the dead worker")
    assert fleet.indexed_blocks(1) == 0
    server.restart().wait_healthy()
    until(lambda: fleet.workers()[1]["healthy"] is True, "the router saw worker 1 back")
    complete_direct(fleet, server, text)
    until(lambda: fleet.indexed_blocks(1) > 0, "worker 1's new blocks were indexed")
    answer = httpx.post(
        f"{fleet.router.url}/v1/completions",
        json={"model": fleet.model, "prompt": text + "Again.", "max_tokens": 2},
        timeout=120,
    )
    assert answer.status_code == 200 and worker_index(answer) == 1
    assert "reason=cache_hit" in answer.headers["x-kvserve-decision"]


def test_blocks_evicted_from_a_full_cache_leave_the_index(fleet: Fleet) -> None:
    server = fleet.vllm[0]
    prompt = [(7 * i + 3) % 900 + 50 for i in range(8 * BLOCK_SIZE)]
    complete_direct(fleet, server, prompt)
    removed = fleet.link.removed_blocks
    # Three cold prompts of 47 blocks each take more than the whole cache: vLLM evicts
    # the least recently used blocks, the first prompt's before any of theirs.
    cold_tokens, cold_prompts = 1500, 3
    for k in range(cold_prompts):
        complete_direct(
            fleet, server, [(13 * i + 101 * k + 5) % 900 + 50 for i in range(cold_tokens)]
        )
    allocated = cold_prompts * -(-cold_tokens // BLOCK_SIZE)
    until(lambda: fleet.link.removed_blocks >= removed + allocated - KV_BLOCKS, "vLLM evicted")
    published = fleet.link.last_seq
    until(lambda: fleet.stream(0)["next_seq"] > published, "the router applied the evictions")
    assert fleet.indexed_blocks(0) <= KV_BLOCKS
    answer = httpx.post(
        f"{fleet.router.url}/v1/completions",
        json={"model": fleet.model, "prompt": [*prompt, 60, 61], "max_tokens": 2},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    assert "reason=cache_miss" in answer.headers["x-kvserve-decision"], answer.headers
