"""kv_aware with ``--processes 2``: each process follows every worker's KV events itself,
so a prompt cached on a worker is a hit whichever process routes the next turn; the
guards of both return to zero. (The copying of speculative blocks, queued prefills and
load changes between processes is checked in ``test_sibling_links.py``.)"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.router.local_fleet import ServerProcess
from kvserve.router.ports import free_port
from tests.router.test_kv_aware_e2e import chat, model_dir, start_sim_worker
from tests.support.metrics_text import samples_of_every_process
from tests.support.processes import start_router

__all__ = ["model_dir"]  # the module fixture, shared


@pytest.fixture(scope="module")
def router(model_dir: Path) -> Iterator[ServerProcess]:
    workers: list[ServerProcess] = []
    process = None
    try:
        workers = [start_sim_worker(model_dir) for _ in range(2)]
        urls = [w.url for w in workers]
        # Sibling processes are not salted as replicas: with the default spread, these
        # short prompts' hits hold whichever process routes the next turn.
        process = start_router(urls, free_port(), "--policy", "kv_aware", "--processes", "2")
        yield process
    finally:
        for server in [process, *workers]:
            if server is not None:
                server.stop()


def _poll(condition: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def _from_both(router: ServerProcess, body: dict) -> list[httpx.Response]:  # type: ignore[type-arg]
    """The same request on fresh connections until both processes have answered it."""
    answers: dict[str, httpx.Response] = {}
    for _ in range(60):
        response = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        answers.setdefault(response.headers["x-kvserve-router-process"], response)
        if len(answers) == 2:
            return list(answers.values())
    pytest.fail("every request went to the same process")


def test_a_turn_cached_on_a_worker_is_a_hit_from_either_process(
    router: ServerProcess, model_dir: Path
) -> None:
    model = str(model_dir)
    first = httpx.post(
        f"{router.url}/v1/chat/completions", json=chat(model, "About rivers."), timeout=30
    )
    holder = first.headers["x-kvserve-worker"]

    def indexed_by_both() -> bool:
        held = (
            value
            for found in samples_of_every_process(router.url + "/metrics", 2)
            for (name, labels), value in found.items()
            if name == "kvserve_router_kv_index_blocks"
            and {("worker", holder), ("tier", "device")} <= labels
        )
        return sum(1 for value in held if value > 0) == 2

    _poll(indexed_by_both, "both processes indexed the holder's events")
    time.sleep(2.5)  # a timer, not a sync: the speculative TTL (2 s) has lapsed after it
    for answer in _from_both(router, chat(model, "About stones.")):
        decision = answer.headers["x-kvserve-decision"]
        assert "reason=cache_hit" in decision, decision
        assert answer.headers["x-kvserve-worker"] == holder

    def idle() -> bool:
        workers = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
        return all(w["in_flight_requests"] == 0 for w in workers) and all(
            w["in_flight_prefill_tokens"] == 0 for w in workers
        )

    _poll(idle, "load back to zero")
