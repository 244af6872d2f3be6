"""``kvserve up`` keeps its fleet up under load: a worker killed (SIGKILL) is restarted on
its own URL and readmitted; a hung worker (SIGSTOP) is taken out by the router's health
checks and readmitted after SIGCONT. Throughout, no request hangs, requests that had not
started streaming are retried, and nothing stays held afterwards."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvserve.bench.steady_load import Outcome, SteadyLoad
from kvserve.router.local_fleet import ServerProcess
from tests.support.ledger_check import ledger_check
from tests.support.metrics_text import by_label, samples
from tests.support.up_fleet import start_up, worker_pids

HEAL_DEADLINE_S = 60.0
BODY = {"model": "tiny-llama", "prompt": "Hello there", "max_tokens": 4}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cache_dir = tmp_path_factory.mktemp("kvserve-cache")
    process = start_up(cache_dir, "--workers", "2", "--runner", "sim", "--policy", "round_robin")
    yield process
    process.stop()


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.1)


def started_more_than(up: ServerProcess, name: str, starts: int) -> Callable[[], bool]:
    return lambda: len(worker_pids(up, name)) > starts


def listed(up: ServerProcess) -> dict[str, dict[str, object]]:
    workers = httpx.get(up.url + "/workers", timeout=10).json()["workers"]
    return {str(w["id"]): w for w in workers}


def serves(up: ServerProcess, worker_id: str) -> bool:
    """Whether a request lands on ``worker_id`` (round robin: one of a few in a row does)."""
    for _ in range(4):
        answer = httpx.post(up.url + "/v1/completions", json=BODY, timeout=30)
        if answer.status_code == 200 and answer.headers["x-kvserve-worker"] == worker_id:
            return True
    return False


def router_retries(up: ServerProcess) -> float:
    return sum(
        by_label(samples(up.url + "/metrics"), "kvserve_router_retries_total", "worker").values()
    )


def assert_nothing_held(up: ServerProcess) -> None:
    """Router load back to zero; each worker idle with an intact KV ledger."""

    def router_idle() -> bool:
        return all(w["in_flight_requests"] == 0 for w in listed(up).values())

    wait_for(router_idle, 30, "the router's load guards released")
    for worker in listed(up).values():
        url = str(worker["url"])

        def idle(url: str = url) -> bool:
            load = httpx.get(url + "/load", timeout=10).json()
            return load["running"] == 0 and load["waiting"] == 0

        wait_for(idle, 30, f"{url} idle")
        assert ledger_check(url) == {"ok": True}


def assert_none_hung_and_only_streams_cut(outcomes: list[Outcome], victim: str) -> None:
    assert outcomes, "the load sent nothing"
    for outcome in outcomes:
        assert outcome.status is not None, outcome  # every request got an HTTP answer
        if outcome.complete:
            continue
        # Only a stream the victim had started may be cut; anything else was retried.
        assert outcome.streamed and outcome.worker == victim, outcome
        assert outcome.error is not None and "stream_broken" in outcome.error, outcome


def test_a_worker_killed_under_load_is_restarted_on_its_url_and_readmitted(up) -> None:
    workers = listed(up)
    victim = "w1"
    victim_url = str(workers[victim]["url"])
    (pid,) = worker_pids(up, "worker1")
    load = SteadyLoad(up.url, model="tiny-llama", clients=6, max_tokens=48).start()
    try:
        wait_for(
            lambda: {o.worker for o in load.outcomes() if o.complete} >= set(workers),
            60,
            "both workers serving the load",
        )
        retries_before = router_retries(up)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: len(worker_pids(up, "worker1")) == 2, HEAL_DEADLINE_S, "a restart")
        restarted = worker_pids(up, "worker1")[-1]
        assert restarted != pid
        wait_for(lambda: listed(up)[victim]["healthy"] is True, HEAL_DEADLINE_S, "readmitted")

        def served_by_victim_since_kill() -> bool:
            return any(
                o.complete and o.worker == victim and o.started > killed_at for o in load.outcomes()
            )

        wait_for(served_by_victim_since_kill, HEAL_DEADLINE_S, "the restarted worker serving")
        healed_s = time.monotonic() - killed_at
    finally:
        outcomes = load.stop()
    assert healed_s < HEAL_DEADLINE_S
    assert httpx.get(victim_url + "/health", timeout=10).status_code == 200  # same URL
    assert_none_hung_and_only_streams_cut(outcomes, victim)
    assert router_retries(up) > retries_before  # requests sent to the dead worker were retried
    restarts = by_label(
        samples(up.url + "/metrics"), "kvserve_router_worker_restarts_total", "worker"
    )
    assert restarts.get(victim) == 1.0, restarts  # the router noticed the new instance
    assert "worker1 exited (killed by SIGKILL); restart 1" in up.log_tail(200)
    assert up.alive()
    assert_nothing_held(up)


def test_a_hung_worker_is_taken_out_and_readmitted_after_sigcont(up) -> None:
    victim = "w0"
    pid = worker_pids(up, "worker0")[-1]
    load = SteadyLoad(up.url, model="tiny-llama", clients=6, max_tokens=48).start()
    stopped = False
    try:
        wait_for(lambda: len([o for o in load.outcomes() if o.complete]) >= 6, 60, "load flowing")
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        wait_for(
            lambda: listed(up)[victim]["healthy"] is False,
            HEAL_DEADLINE_S,
            "the hung worker taken out",
        )
        taken_out_at = time.monotonic()

        def unstreamed_sent_before_retried() -> bool:
            """No unstreamed request sent before the worker was taken out still waits:
            those the hung worker held were retried elsewhere (it would hold them until
            SIGCONT otherwise)."""
            return all(t > taken_out_at for t in load.in_flight(streamed=False))

        wait_for(unstreamed_sent_before_retried, 30, "unstreamed requests retried elsewhere")
        # Taken out: new requests go to the other worker and are answered promptly.
        for _ in range(3):
            started = time.monotonic()
            answer = httpx.post(up.url + "/v1/completions", json=BODY, timeout=30)
            assert answer.status_code == 200 and answer.headers["x-kvserve-worker"] == "w1"
            assert time.monotonic() - started < 10
        os.kill(pid, signal.SIGCONT)
        stopped = False
        wait_for(lambda: listed(up)[victim]["healthy"] is True, HEAL_DEADLINE_S, "readmitted")
        wait_for(lambda: serves(up, victim), HEAL_DEADLINE_S, "the resumed worker serving")
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        outcomes = load.stop()
    # The streams it had started finish after SIGCONT, the rest were retried: none lost.
    assert all(o.status == 200 and o.complete for o in outcomes), [
        o for o in outcomes if not o.complete
    ]
    assert worker_pids(up, "worker0")[-1] == pid  # not restarted: it was alive all along
    assert_nothing_held(up)


def test_a_worker_dying_right_after_each_start_is_reported_as_a_crash_loop(up) -> None:
    pids = worker_pids(up, "worker1")
    for _ in range(4):  # deaths 2-4 come long before the 30 s that make a stable run
        os.kill(pids[-1], signal.SIGKILL)
        wait_for(started_more_than(up, "worker1", len(pids)), 60, "a restart")
        pids = worker_pids(up, "worker1")
    log = up.log_tail(400)
    assert re.search(r"worker1 is crash-looping \([34] quick exits in a row\)", log), log
    delays = [float(d) for d in re.findall(r"^worker1 exited .* in ([\d.]+)s on", log, re.M)]
    assert delays[-3:] == sorted(delays[-3:]) and delays[-1] >= 2.0, delays  # backing off
    report = log[log.rindex("is crash-looping") :]
    assert "worker1.log) ends:" in report and "kvserve worker" in report  # its log's tail
    wait_for(lambda: serves(up, "w1"), HEAL_DEADLINE_S, "back after the crash loop")
    assert up.alive()


def test_up_exits_when_its_router_dies_and_takes_the_workers_with_it(up) -> None:
    worker_urls = [str(w["url"]) for w in listed(up).values()]
    (router_pid,) = worker_pids(up, "router")
    os.kill(router_pid, signal.SIGKILL)
    assert up.process.wait(timeout=60) == 1
    assert "the router exited (killed by SIGKILL); stopping the fleet" in up.log_tail(100)
    for url in worker_urls:
        with pytest.raises(httpx.TransportError):  # refused, or reset by a dying server
            httpx.get(url + "/health", timeout=2.0)
