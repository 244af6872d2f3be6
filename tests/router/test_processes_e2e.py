"""``kvserve router --processes 2``: two processes on one port share load and the tree.

Real processes on 127.0.0.1: the router's two children (SO_REUSEPORT) over foreign
servers A, B, C. Each request opens its own connection, so the kernel spreads them over
both processes; ``x-kvserve-router-process`` says which one answered.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from kvserve.router.config import RouterConfig
from kvserve.router.local_fleet import KVSERVE_COMMAND
from kvserve.router.ports import free_port
from tests.support.processes import ServerProcess, start_foreign_server, start_router

HELD_PROMPT = "p" * 40  # 10 prefill tokens at 4 characters a token


@pytest.fixture(scope="module")
def router(foreign_fleet: list[ServerProcess]) -> Iterator[ServerProcess]:
    urls = [server.url for server in foreign_fleet]
    with start_router(urls, free_port(), "--processes", "2") as process:
        yield process


def _poll(condition: Callable[[], bool], what: str, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def _workers(router: ServerProcess) -> list[dict]:  # type: ignore[type-arg]
    return httpx.get(router.url + "/workers", timeout=10).json()["workers"]


def _children(router: ServerProcess) -> list[psutil.Process]:
    return psutil.Process(router.process.pid).children()


def test_guards_of_both_processes_are_summed_exactly(router: ServerProcess) -> None:
    """Requests held by both processes at once: every process's /workers shows the total
    (and each process's share), then exactly zero once they end."""
    count = 16
    body = {"prompt": HELD_PROMPT, "x_test": {"delay": 8.0}}  # long enough to overlap all

    def send(_: int) -> str:
        response = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        return response.headers["x-kvserve-router-process"]

    seen: dict[str, tuple[int, int, list[int]]] = {}

    def totals() -> tuple[int, int, list[int]]:
        workers = _workers(router)
        shares = [w["in_flight_requests_by_process"] for w in workers]
        by_process = [sum(p) for p in zip(*shares, strict=True)]
        requests = sum(w["in_flight_requests"] for w in workers)
        return requests, sum(w["in_flight_prefill_tokens"] for w in workers), by_process

    def all_held() -> bool:
        now = totals()
        seen["last"] = now
        return now[0] == count

    with ThreadPoolExecutor(count) as pool:
        answered = pool.map(send, range(count))
        _poll(all_held, f"{count} requests held; last {seen.get('last')}")
        _, tokens, by_process = seen["last"]
        assert tokens == 10 * count  # each held its prefill until its answer
        assert sum(by_process) == count
        processes = list(answered)
    assert sorted(by_process) == sorted(processes.count(p) for p in ("0", "1"))
    assert set(processes) == {"0", "1"}, "the kernel gave one process every connection"
    _poll(lambda: totals() == (0, 0, [0, 0]), "load back to zero")
    for _ in range(6):  # whichever process answers, it reads the same zero
        assert totals() == (0, 0, [0, 0])


def test_a_prompt_routed_by_one_process_is_a_hit_in_the_other(router: ServerProcess) -> None:
    body = {"prompt": f"a conversation that only this test sends {time.time()}", "max_tokens": 2}
    first = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert first.status_code == 200
    worker = first.headers["x-kvserve-worker"]
    processes = {first.headers["x-kvserve-router-process"]}
    for _ in range(60):  # a fresh connection each: either process may take it
        again = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
        assert again.headers["x-kvserve-worker"] == worker
        assert "reason=cache_hit" in again.headers["x-kvserve-decision"]
        processes.add(again.headers["x-kvserve-router-process"])
        if len(processes) == 2:
            return
    pytest.fail("every request went to the same process")


def _workers_of_each_process(router: ServerProcess) -> dict[str, list[str]]:
    """Each process's worker ids, from /workers on fresh connections until both answered."""
    seen: dict[str, list[str]] = {}
    for _ in range(60):
        answer = httpx.get(router.url + "/workers", timeout=10)
        ids = [w["id"] for w in answer.json()["workers"]]
        seen.setdefault(answer.headers["x-kvserve-router-process"], ids)
        if len(seen) == 2:
            return seen
    pytest.fail("every request went to the same process")


def test_workers_added_and_removed_through_either_process_change_both(
    router: ServerProcess,
) -> None:
    """Process 0 orders the changes: the same ids everywhere, even for additions sent to
    both processes at once; a removal through one stops both routing there."""
    extra = [start_foreign_server(name, free_port()) for name in "DE"]
    try:
        with ThreadPoolExecutor(4) as pool:  # fresh connections: either process may answer
            added = list(
                pool.map(lambda s: httpx.post(router.url + "/workers", json={"url": s.url}), extra)
            )
        assert [a.status_code for a in added] == [201, 201], [a.text for a in added]
        new_ids = {a.json()["id"] for a in added}
        assert new_ids == {"w3", "w4"} and all(a.json()["healthy"] for a in added)
        expected = ["w0", "w1", "w2", "w3", "w4"]
        assert _workers_of_each_process(router) == {"0": expected, "1": expected}
        again = httpx.post(router.url + "/workers", json={"url": extra[0].url})
        assert again.status_code == 409 and again.json()["error"]["code"] == "bad_worker"
        for worker_id in sorted(new_ids):
            assert httpx.delete(f"{router.url}/workers/{worker_id}").status_code == 200
        expected = ["w0", "w1", "w2"]
        assert _workers_of_each_process(router) == {"0": expected, "1": expected}
        gone = httpx.delete(f"{router.url}/workers/w4")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_worker"
        for _ in range(20):  # neither process routes to a removed worker
            answer = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
            assert answer.headers["x-kvserve-worker"] in expected
    finally:
        for server in extra:
            server.stop()


def test_metrics_and_the_dashboard_count_every_process_requests(router: ServerProcess) -> None:
    """A scrape of either process, and the dashboard of either, show the router's total."""

    def requests_on_metrics() -> tuple[str, float]:
        answer = httpx.get(router.url + "/metrics", timeout=10)
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in answer.text.splitlines()
            if line.startswith("kvserve_router_requests_total{")
        )
        return answer.headers["x-kvserve-router-process"], total

    before = requests_on_metrics()[1]
    served = set()
    for sent in range(1, 61):  # fresh connections until both processes served some
        answer = httpx.post(router.url + "/v1/completions", json={"prompt": "count"}, timeout=30)
        assert answer.status_code == 200
        served.add(answer.headers["x-kvserve-router-process"])
        if len(served) == 2 and sent >= 6:
            break
    assert served == {"0", "1"}
    totals = {}
    for _ in range(60):
        process, total = requests_on_metrics()
        totals[process] = total
        if len(totals) == 2:
            break
    assert totals == {"0": before + sent, "1": before + sent}

    def dashboards_agree() -> bool:  # 20 fresh connections: both processes answer some
        counts = {
            httpx.get(router.url + "/dashboard/data", timeout=10).json()["fleet"]["requests"]
            for _ in range(20)
        }
        return counts == {before + sent}

    _poll(dashboards_agree, "both dashboards count every request", within_s=30)


def test_sigterm_to_the_parent_stops_every_process(foreign_fleet: list[ServerProcess]) -> None:
    process = start_router([foreign_fleet[0].url], free_port(), "--processes", "2")
    try:
        children = _children(process)
        assert len(children) == 2
        os.kill(process.process.pid, signal.SIGTERM)  # the parent only, not its group
        assert process.process.wait(20) == 0
        assert not psutil.wait_procs(children, timeout=20)[1]
    finally:
        process.stop()


def test_a_dead_process_stops_the_group(foreign_fleet: list[ServerProcess]) -> None:
    process = start_router([foreign_fleet[0].url], free_port(), "--processes", "2")
    try:
        first, second = _children(process)
        first.kill()
        assert process.process.wait(20) == 1
        assert not psutil.wait_procs([second], timeout=20)[1]
        assert "exited with -9: stopping the others" in process.log_tail()
    finally:
        process.stop()


def test_a_port_another_router_serves_is_refused(
    router: ServerProcess, foreign_fleet: list[ServerProcess]
) -> None:
    """SO_REUSEPORT would let a second router share the first one's port unnoticed."""
    port = router.url.rsplit(":", 1)[1]
    args = [*KVSERVE_COMMAND, "router", "--port", port, "--processes", "2"]
    second = ServerProcess([*args, "--worker-urls", foreign_fleet[0].url], router.url)
    try:
        assert second.process.wait(60) != 0
        assert f"cannot serve on 127.0.0.1:{port}" in second.log_tail()
    finally:
        second.stop()
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"port": 0}, "fixed --port"),
        # replicas on one port announce to each other; peers too would need both loads
        ({"port": 8123, "peer_urls": ("http://127.0.0.1:9",)}, "--peers cannot be combined"),
    ],
)
def test_options_several_processes_cannot_take_are_refused(options: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        RouterConfig(worker_urls=("http://w:1",), processes=2, **options)
