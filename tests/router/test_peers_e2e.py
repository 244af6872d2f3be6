"""Two real router replicas peering (``--peers``) over two cost-model workers: a request in
flight on one replica steers the other's decisions, both see every guard back to zero
afterwards; a peer that is down is skipped without stalling routing; a malformed
announcement is refused with OpenAI's error body."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port
from tests.support.processes import start_router

DEADLINE_S = 60.0  # generous: CI boxes are loaded


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("peers-model"), "llama")


def start_worker(model_dir: Path) -> ServerProcess:
    """Decode steps as long as an 8B model's on an H100: a long answer stays in flight."""
    port = free_port()
    args = [
        *KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port),
        "--runner", "sim", "--sim-profile", "llama3-8b-h100", "--num-blocks", "512",
        "--block-size", "16", "--served-model-name", str(model_dir),
    ]  # fmt: skip
    return ServerProcess(args, f"http://127.0.0.1:{port}", name="sim-worker").wait_healthy(90)


@pytest.fixture(scope="module")
def replicas(model_dir: Path) -> Iterator[tuple[ServerProcess, ServerProcess, list[str]]]:
    servers: list[ServerProcess] = []
    try:
        workers = [start_worker(model_dir) for _ in range(2)]
        servers += workers
        urls = [w.url for w in workers]
        port_a, port_b = free_port(), free_port()
        # No replica salt: it would outweigh these short prompts' hits by a hash of the
        # (random) ports; what is checked is what announcements carry.
        unsalted = ("--policy", "kv_aware", "--kv-aware-replica-spread", "0")
        a = start_router(urls, port_a, *unsalted, "--peers", f"http://127.0.0.1:{port_b}")
        servers.append(a)
        b = start_router(  # the workers in another order: B numbers them differently
            urls[::-1], port_b, *unsalted, "--peers", f"http://127.0.0.1:{port_a}"
        )
        servers.append(b)
        yield a, b, [w.url for w in workers]
    finally:
        for server in reversed(servers):
            server.stop()


def workers_of(router: ServerProcess) -> dict[str, dict]:
    """The router's workers by URL (replicas number them each in their own order)."""
    listed = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    return {w["url"]: w for w in listed}


def served_by(router: ServerProcess, response: httpx.Response) -> str:
    """The URL of the worker that served ``response`` through ``router``."""
    worker_id = response.headers["x-kvserve-worker"]
    return next(url for url, w in workers_of(router).items() if w["id"] == worker_id)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def all_released(router: ServerProcess) -> bool:
    return all(
        (w["in_flight_requests"], w["in_flight_prefill_tokens"])
        == (0, 0)
        == (w["peers_in_flight_requests"], w["peers_in_flight_prefill_tokens"])
        for w in workers_of(router).values()
    )


def complete(router: ServerProcess, model: str, prompt: str, max_tokens: int) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    response = httpx.post(router.url + "/v1/completions", json=body, timeout=DEADLINE_S)
    assert response.status_code == 200, response.text
    return response


def test_a_request_in_flight_on_one_replica_steers_the_other(replicas, model_dir: Path) -> None:
    a, b, _ = replicas
    model = str(model_dir)
    wait_for(lambda: all(p["up"] for p in httpx.get(a.url + "/peers").json()["peers"]), "A->B")
    long_body = {
        "model": model,
        "prompt": "Tell me a very long story about lighthouses and the sea. " * 4,
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    started = threading.Event()
    busy_ids: list[str] = []
    stop = threading.Event()

    def stream_through_a() -> None:
        with httpx.stream(
            "POST", a.url + "/v1/completions", json=long_body, timeout=DEADLINE_S
        ) as response:
            busy_ids.append(response.headers["x-kvserve-worker"])
            for _ in response.iter_bytes():
                started.set()
                if stop.is_set():
                    return  # the client leaves: the router releases the guard

    streamer = threading.Thread(target=stream_through_a)
    streamer.start()
    try:
        assert started.wait(DEADLINE_S), "the long request never streamed"
        (busy_id,) = busy_ids
        busy = next(url for url, w in workers_of(a).items() if w["id"] == busy_id)
        wait_for(lambda: workers_of(b)[busy]["peers_in_flight_requests"] == 1, "B to hear of it")
        assert workers_of(b)[busy]["in_flight_requests"] == 0  # A's guard, not B's
        # Fresh prompts (nothing cached anywhere) through B avoid the worker A keeps busy.
        for i in range(4):
            answer = complete(b, model, f"{i} {'quartz ' * (i + 1)}question number {i}?", 1)
            assert served_by(b, answer) != busy, f"request {i}"
            assert "reason=cache_miss" in answer.headers["x-kvserve-decision"]
    finally:
        stop.set()
        streamer.join(DEADLINE_S)
    wait_for(lambda: all_released(a) and all_released(b), "every guard released on both")


def test_a_choice_on_one_replica_is_a_hit_on_the_other(replicas, model_dir: Path) -> None:
    a, b, _ = replicas
    model = str(model_dir)
    prompt = "A conversation about tides, harbours and the ships that use them. " * 6
    first = complete(a, model, prompt, 1)
    # B was told the choice (and later the worker's events): the same prompt follows it.
    second = complete(b, model, prompt + "And the next turn?", 1)
    assert served_by(b, second) == served_by(a, first)
    assert "reason=cache_hit" in second.headers["x-kvserve-decision"]
    peers_of_b = httpx.get(b.url + "/peers").json()
    assert peers_of_b["choices_recorded"] >= 1 and peers_of_b["received"] >= 1
    (a_to_b,) = httpx.get(a.url + "/peers").json()["peers"]
    assert a_to_b["up"] and a_to_b["messages"] >= 1  # over the stream, not a POST each
    wait_for(lambda: all_released(a) and all_released(b), "every guard released on both")


def test_a_malformed_announcement_is_refused(replicas) -> None:
    a, _, _ = replicas
    for body in (b"{not json", b'{"origin": "x"}', b'[{"origin": "x", "loads": [["w", -1, 0]]}]'):
        response = httpx.post(a.url + "/peers/announcements", content=body, timeout=10)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "bad_announcement" and error["type"] == "invalid_request_error"


def test_a_malformed_stream_message_closes_the_stream(replicas) -> None:
    a, _, _ = replicas

    async def send_garbage() -> int | None:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(a.url + "/peers/stream") as stream,
        ):
            await stream.send_bytes(b'[{"origin": 7}]')
            message = await stream.receive(timeout=DEADLINE_S)
            assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            return stream.close_code

    assert asyncio.run(send_garbage()) == aiohttp.WSCloseCode.UNSUPPORTED_DATA


def test_a_peer_that_is_down_stalls_nothing(replicas, model_dir: Path) -> None:
    _, _, worker_urls = replicas
    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    with start_router(worker_urls, free_port(), "--policy", "kv_aware", "--peers", dead) as c:
        for i in range(3):
            complete(c, str(model_dir), f"{i} alone, with a dead peer", 1)
        wait_for(lambda: httpx.get(c.url + "/peers").json()["peers"][0]["failures"] >= 1, "a try")
        (peer,) = httpx.get(c.url + "/peers").json()["peers"]
        assert peer["url"] == dead and not peer["up"]
