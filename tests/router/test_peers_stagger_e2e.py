"""Two real router replicas taking turns (``--kv-aware-replica-stagger``): requests that
reach both at one instant are decided by the lower-ranked replica first, and the other,
deferring, hears that choice before it makes its own."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.router.local_fleet import ServerProcess
from kvserve.router.ports import free_port
from tests.router.test_peers_e2e import (
    DEADLINE_S,
    all_released,
    complete,
    served_by,
    start_worker,
    wait_for,
    workers_of,
)
from tests.support.processes import start_router

STAGGER_S = 1.0  # far above an announcement's delay, even on a loaded CI box


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("stagger-model"), "llama")


@pytest.fixture(scope="module")
def ranked(model_dir: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(rank 0, rank 1): the replica on the lower port is rank 0. Every decision takes
    its turn (no burst window), none is salted."""
    servers: list[ServerProcess] = []
    try:
        workers = [start_worker(model_dir) for _ in range(2)]
        servers += workers
        urls = [w.url for w in workers]
        low, high = sorted((free_port(), free_port()))
        taking_turns = (
            "--policy", "kv_aware", "--kv-aware-replica-spread", "0",
            "--kv-aware-replica-stagger", str(STAGGER_S),
            "--kv-aware-replica-burst-window", "0",
        )  # fmt: skip
        first = start_router(urls, low, *taking_turns, "--peers", f"http://127.0.0.1:{high}")
        servers.append(first)
        second = start_router(urls, high, *taking_turns, "--peers", f"http://127.0.0.1:{low}")
        servers.append(second)
        yield first, second
    finally:
        for server in reversed(servers):
            server.stop()


def stream(router: ServerProcess, body: dict, taken: list[str], stop: threading.Event) -> None:
    """A long streamed answer through ``router``, its worker's URL put in ``taken``,
    held in flight until ``stop``."""
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=DEADLINE_S) as r:
        worker_id = r.headers["x-kvserve-worker"]
        taken.append(next(u for u, w in workers_of(router).items() if w["id"] == worker_id))
        for _ in r.iter_bytes():
            if stop.is_set():
                return  # the client leaves: the router releases the guard


def peers_up(router: ServerProcess) -> bool:
    return all(peer["up"] for peer in httpx.get(router.url + "/peers").json()["peers"])


def test_the_higher_rank_decides_after_hearing_the_lower(ranked, model_dir: Path) -> None:
    """Three rounds, each a long answer through rank 0 and a fresh prompt through rank
    1 sent at the same instant: rank 1 always avoids the worker rank 0 just took (one
    deciding blind would take it half the time)."""
    first, second = ranked
    model = str(model_dir)
    for router in ranked:
        wait_for(lambda router=router: peers_up(router), "the replicas to peer")
    for round_ in range(3):
        long_body = {
            "model": model,
            "prompt": f"Round {round_}: a very long story about lighthouses. " * 4,
            "max_tokens": 2000,
            "stream": True,
            "ignore_eos": True,
        }
        taken: list[str] = []
        stop = threading.Event()

        streamer = threading.Thread(target=stream, args=(first, long_body, taken, stop))
        streamer.start()
        try:
            answer = complete(second, model, f"{round_} {'quartz ' * (round_ + 1)}fresh?", 1)
            wait_for(lambda taken=taken: bool(taken), "rank 0's choice")
            assert served_by(second, answer) != taken[0], f"round {round_}"
        finally:
            stop.set()
            streamer.join(DEADLINE_S)
        wait_for(lambda: all_released(first) and all_released(second), "guards released")
