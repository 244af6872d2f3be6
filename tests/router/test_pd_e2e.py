"""Prefill/decode disaggregation end to end: real workers (one prefill, two decode, one
mixed for reference) behind a PD router; greedy output, cache hits on both sides, and
every way a request can be cut short leaving every worker and the router at baseline.
All of it over the built-in TCP transfer and over the Mooncake Transfer Engine, and over TCP
with a router of two processes (``--processes 2``)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import pytest

from kvserve.engine.pd_import import DEFAULT_LEASE_TTL_S
from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port
from tests.support.ledger_check import ledger_check
from tests.support.metrics_text import by_label, samples
from tests.support.shm_maps import segments_mapped_by_a_peer

T = TypeVar("T")

NUM_BLOCKS = 512
GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True, "max_tokens": 12}
GAUGES = ("kvserve_router_in_flight_requests", "kvserve_router_in_flight_prefill_tokens")


def words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


def start_worker(model_dir: Path, *options: str) -> ServerProcess:
    port = free_port()
    args = [*KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port)]
    args += ["--num-blocks", str(NUM_BLOCKS), "--device", "cpu", "--served-model-name", "tiny"]
    args += options
    return ServerProcess(args, f"http://127.0.0.1:{port}", name="worker", env=_ONE_THREAD)


_ONE_THREAD = {"OMP_NUM_THREADS": "1"}


class Fleet:
    def __init__(
        self, model_dir: Path, kv_transfer: str, processes: int = 1, same_host: str = "shm"
    ) -> None:
        # A small step budget makes a long prompt's prefill last long enough to cut into.
        self.model_dir = model_dir
        self.same_host = same_host
        self.killed: set[int] = set()  # workers a test SIGKILLed: their segments may stay
        transfer = ("--kv-transfer", kv_transfer, "--kv-transfer-same-host", same_host)
        self.prefill = start_worker(
            model_dir, "--role", "prefill", "--max-num-batched-tokens", "16", *transfer
        )
        self.decodes = [start_worker(model_dir, "--role", "decode", *transfer) for _ in range(2)]
        self.mixed = start_worker(model_dir)
        for worker in [*self.workers, self.mixed]:
            worker.wait_healthy(120)
        port = free_port()
        args = [*KVSERVE_COMMAND, "router", "--port", str(port), "--prefill", self.prefill.url]
        args += ["--decode", ",".join(d.url for d in self.decodes), "--health-check-interval", "1"]
        args += ["--max-retries", "2", "--retry-initial-backoff", "0.01"]
        args += ["--processes", str(processes)]
        self.router = ServerProcess(args, f"http://127.0.0.1:{port}", name="router").wait_healthy()

    @property
    def workers(self) -> list[ServerProcess]:
        return [self.prefill, *self.decodes]

    def stop(self) -> None:
        for process in [self.router, *self.workers, self.mixed]:
            process.stop()


@pytest.fixture(
    scope="module",
    params=[("tcp", 1, "shm"), ("mooncake", 1, "shm"), ("tcp", 2, "socket")],
    ids=["tcp-shm", "mooncake", "tcp-socket-2-processes"],
)
def fleet(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Fleet]:
    from kvserve.engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path_factory.mktemp("pd-model"), "llama")
    fleet = Fleet(model_dir, *request.param)
    pids = {worker.process.pid for worker in fleet.workers}
    try:
        yield fleet
    finally:
        fleet.stop()
    assert shm_segments(pids - fleet.killed) == set()  # workers that exit unlink theirs


def shm_segments(pids: set[int]) -> set[str]:
    """The same-host transfer's segments in /dev/shm made by the processes ``pids``."""
    return {
        name
        for name in os.listdir("/dev/shm")
        if name.startswith("kvserve-pd-") and int(name.split("-")[2]) in pids
    }


def complete(url: str, prompt: str, **extra: Any) -> httpx.Response:
    response = httpx.post(
        url + "/v1/completions", json={**GREEDY, "prompt": prompt, **extra}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response


def cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def reason(response: httpx.Response) -> str:
    return response.headers["x-kvserve-decision"].split("reason=")[1].split(";")[0]


def assert_served_by(
    fleet: Fleet, response: httpx.Response, path: str, *, prefill_worker: bool
) -> None:
    """The decode worker answers; the prefill worker is named only when its KV was used."""
    listed = httpx.get(fleet.router.url + "/workers", timeout=5).json()["workers"]
    pools = {worker["id"]: worker["pool"] for worker in listed}
    headers = response.headers
    assert headers["x-kvserve-pd"] == path
    assert pools[headers["x-kvserve-worker"]] == "decode"
    assert ("x-kvserve-prefill-worker" in headers) == prefill_worker
    if prefill_worker:
        assert pools[headers["x-kvserve-prefill-worker"]] == "prefill"
        assert f"prefill={headers['x-kvserve-prefill-worker']}" in headers["x-kvserve-decision"]


def load(worker: ServerProcess) -> dict[str, Any]:
    return httpx.get(worker.url + "/load", timeout=5).json()


def assert_at_baseline(fleet: Fleet, within_s: float = 10.0) -> None:
    """Nothing running anywhere, every block free or cached, ledgers sound, gauges zero."""
    deadline = time.monotonic() + within_s
    while True:
        state = {w.url: load(w) for w in fleet.workers if w.alive()}
        gauges = {g: by_label(samples(fleet.router.url + "/metrics"), g, "worker") for g in GAUGES}
        idle = all(
            s["running"] == 0
            and s["waiting"] == 0
            and s["free_blocks"] + s["cached_blocks"] == NUM_BLOCKS
            for s in state.values()
        ) and all(v == 0 for per_worker in gauges.values() for v in per_worker.values())
        if idle:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"not at baseline: {state} {gauges}")
        time.sleep(0.05)
    for worker in fleet.workers:
        if worker.alive():
            assert ledger_check(worker.url) == {"ok": True}
    # Segments of transfers that ended early are unlinked; only a live decode worker's
    # kept ones (at most its pool, 256 MiB) remain.
    live_decodes = {d.process.pid for d in fleet.decodes if d.alive()}
    every = {w.process.pid for w in fleet.workers}
    assert shm_segments(every - live_decodes - fleet.killed) == set()
    kept = sum(os.path.getsize(f"/dev/shm/{name}") for name in shm_segments(live_decodes))
    assert kept <= (256 << 20) * len(live_decodes)


def test_pd_output_is_the_mixed_workers_greedy_output(fleet: Fleet) -> None:
    for tag in ("alpha", "beta"):
        prompt = words(tag, 120)
        pd = complete(fleet.router.url, prompt)
        assert reason(pd) == "remote"
        assert_served_by(fleet, pd, "remote", prefill_worker=True)
        assert (
            pd.json()["choices"][0]["text"]
            == complete(fleet.mixed.url, prompt).json()["choices"][0]["text"]
        )
    # The built-in transfer between workers of one host went through shared memory (the
    # prefill worker mapped a decode worker's segment to write into it), unless told to
    # use the socket; Mooncake never does.
    decodes_segments = shm_segments({d.process.pid for d in fleet.decodes})
    used_shm = bool(segments_mapped_by_a_peer() & decodes_segments)
    assert used_shm == (fleet.same_host == "shm" and "mooncake" not in fleet.prefill.args)
    chat = {"messages": [{"role": "user", "content": words("gamma", 100)}], **GREEDY}
    answers = [
        httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()
        for url in (fleet.router.url, fleet.mixed.url)
    ]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert_at_baseline(fleet)


def test_structured_output_and_forced_tool_calls_in_pd_mode(fleet: Fleet) -> None:
    """The decode worker serves /pd/v1 as /v1: constrained output and tool calls, with the
    prompt's KV from the prefill worker."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    base = {"model": "tiny", "max_tokens": 60, "seed": 0}
    messages = [{"role": "user", "content": words("delta", 120)}]
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    answer = httpx.post(
        fleet.router.url + "/v1/chat/completions",
        json={**base, "messages": messages, "response_format": response_format},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert_served_by(fleet, answer, "remote", prefill_worker=True)
    assert 0 <= json.loads(answer.json()["choices"][0]["message"]["content"])["n"] <= 9
    tool = {"type": "function", "function": {"name": "count", "parameters": schema}}
    named = {"type": "function", "function": {"name": "count"}}
    body = {**base, "messages": messages, "tools": [tool], "tool_choice": named}
    called = httpx.post(fleet.router.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert called["choices"][0]["finish_reason"] == "tool_calls"
    [call] = called["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]).keys() == {"n"}
    assert_at_baseline(fleet)


def test_prefill_cache_hits_and_decode_side_reuse(fleet: Fleet) -> None:
    shared = words("shared", 150)
    complete(fleet.router.url, shared + " " + words("first", 50))
    second = shared + " " + words("second", 50)
    hit = complete(fleet.router.url, second)
    assert reason(hit) == "remote"
    assert cached_tokens(hit) >= 16 * 20  # the prefill worker's cache served the shared part
    again = complete(fleet.router.url, second)  # the decode worker holds it all now
    assert reason(again).startswith("local") and cached_tokens(again) > cached_tokens(hit)
    assert_served_by(fleet, again, "local", prefill_worker=False)
    direct = httpx.post(
        f"{fleet.decodes[0].url}/pd/v1/completions",
        json={**GREEDY, "prompt": second},
        headers={"x-kvserve-prefill": fleet.prefill.url},
        timeout=60,
    )
    decode_held = httpx.post(
        f"{fleet.decodes[1].url}/pd/v1/completions",
        json={**GREEDY, "prompt": second},
        headers={"x-kvserve-prefill": fleet.prefill.url},
        timeout=60,
    )
    assert {direct.headers["x-kvserve-pd"], decode_held.headers["x-kvserve-pd"]} == {
        "local",
        "remote",
    }
    assert direct.json()["choices"] == decode_held.json()["choices"]
    assert_at_baseline(fleet)


def test_a_cache_salt_keeps_prefill_and_decode_caches_apart(fleet: Fleet) -> None:
    """Salts A, A, B and none over one shared part: only the second A is served from
    cache (the prefill worker's, or the decode worker's own)."""
    shared = words("salted", 150)
    first = complete(fleet.router.url, shared + " " + words("one", 50), cache_salt="A")
    again = complete(fleet.router.url, shared + " " + words("two", 50), cache_salt="A")
    other = complete(fleet.router.url, shared + " " + words("three", 50), cache_salt="B")
    plain = complete(fleet.router.url, shared + " " + words("four", 50))
    assert cached_tokens(first) == 0 and cached_tokens(again) >= 16 * 20
    assert cached_tokens(other) == 0 and cached_tokens(plain) == 0
    assert_at_baseline(fleet)


def test_pd_serves_logprobs_and_refuses_several_choices(fleet: Fleet) -> None:
    """A PD decode route serves one choice per request: logprobs yes, n > 1 a 400."""
    response = complete(fleet.router.url, words("lp", 40), logprobs=2)
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == GREEDY["max_tokens"]
    for prompt, field in (("x", "n"), (["x", "y"], "prompt")):
        extra = {"n": 2} if field == "n" else {}
        refused = httpx.post(
            fleet.router.url + "/v1/completions",
            json={**GREEDY, "prompt": prompt, **extra},
            timeout=60,
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == field
    assert_at_baseline(fleet)


def router_id(fleet: Fleet, worker: ServerProcess) -> str:
    listed = httpx.get(fleet.router.url + "/workers", timeout=5).json()["workers"]
    (worker_id,) = (w["id"] for w in listed if w["url"] == worker.url)
    return worker_id


def router_requests_on(fleet: Fleet, worker_id: str) -> float:
    """The router's in-flight requests gauge for one worker (one scrape: cheap to poll)."""
    held = by_label(samples(fleet.router.url + "/metrics"), GAUGES[0], "worker")
    return held.get(worker_id, 0.0)


# How many requests a test starts to catch one in the state it cuts into (see _catch).
# A CI box under load missed the state five times in a row once (mooncake transfers are
# short): each try that gets past costs one tiny-model request, so try more.
CATCH_ATTEMPTS = 12


def _catch(attempt: Callable[[int], Callable[[], bool]], caught: Callable[[], T | None]) -> T:
    """Start requests until one is seen in the state ``caught`` finds (what it returns).

    ``attempt(n)`` starts the n-th request, with a prompt of its own, and returns whether
    that request has got past the state. The states these tests cut into (a prefill
    worker exporting, the router holding it) last as long as a prefill computes: a second
    or so of a tiny model's steps, while on a loaded box one round of polls can take as
    long. A request that got past between two polls is no failure, so another one is
    tried; only one never seen in ``CATCH_ATTEMPTS`` tries fails the test.
    """
    for n in range(CATCH_ATTEMPTS):
        past = attempt(n)
        deadline = time.monotonic() + 60
        while (found := caught()) is None:
            if past():
                break
            assert time.monotonic() < deadline, f"request {n} neither seen nor done in 60 s"
            time.sleep(0.005)
        else:
            return found
    pytest.fail(f"{CATCH_ATTEMPTS} requests in a row got past the state before it was seen")


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_worker_load_released_when_its_part_is_done(fleet: Fleet, stream: bool) -> None:
    """The router holds the prefill worker's load until the decode worker stopped waiting
    for it, not through the decode (a non-streamed answer once held it to its end)."""
    threads: list[threading.Thread] = []
    result: list[httpx.Response] = []

    def attempt(n: int) -> Callable[[], bool]:
        prompt = f"release{stream}{n} {words('w', 600)}"  # ~2,300 tokens: ~145 steps
        body = {**GREEDY, "prompt": prompt, "max_tokens": 1500}
        body["stream"] = stream

        def send() -> None:
            answer = httpx.post(fleet.router.url + "/v1/completions", json=body, timeout=120)
            result.append(answer)

        for earlier in threads:  # it got past the hold: it finishes before the next starts
            earlier.join(120)
        result.clear()
        threads.append(threading.Thread(target=send))
        threads[-1].start()
        return lambda: not threads[-1].is_alive() or any(load(d)["running"] for d in fleet.decodes)

    prefill = router_id(fleet, fleet.prefill)
    _catch(attempt, lambda: True if router_requests_on(fleet, prefill) > 0 else None)
    deadline = time.monotonic() + 60
    while router_requests_on(fleet, prefill) > 0:
        assert time.monotonic() < deadline, "the prefill worker's load was never released"
        time.sleep(0.002)
    # The decode worker publishes its load after each step: the request it just installed
    # shows as running one step later (under load, after the router already let go).
    deadline = time.monotonic() + 60
    while (decoding := sum(load(d)["running"] for d in fleet.decodes)) == 0:
        if not threads[-1].is_alive():
            break
        assert time.monotonic() < deadline, "the decode worker never ran the request"
        time.sleep(0.002)
    answered_by_then = not threads[-1].is_alive()
    threads[-1].join(120)
    assert not answered_by_then and decoding == 1  # released while the decode ran on
    assert result[0].status_code == 200
    assert result[0].headers["x-kvserve-pd"] == "remote"
    assert_at_baseline(fleet)


def _long_prompt(tag: str) -> str:
    return f"{tag} {words('w', 1000)}"  # ~3,800 tokens: ~240 prefill steps of 16 tokens


def _reserving_decode(fleet: Fleet) -> ServerProcess | None:
    """A decode worker holding leased blocks (neither free nor cached) while the prefill
    worker exports: the request is mid-transfer."""
    if load(fleet.prefill)["running"] == 0:
        return None
    for decode in (d for d in fleet.decodes if d.alive()):  # one may have been killed
        state = load(decode)
        if state["free_blocks"] + state["cached_blocks"] < NUM_BLOCKS:
            return decode
    return None


def _in_background(url: str, prompt: str) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []

    def send() -> None:
        try:
            result.append(
                httpx.post(url + "/v1/completions", json={**GREEDY, "prompt": prompt}, timeout=60)
            )
        except httpx.HTTPError as error:
            result.append(error)

    thread = threading.Thread(target=send)
    thread.start()
    return thread, result


def _catch_mid_transfer(
    fleet: Fleet,
    tag: str,
    caught: Callable[[Fleet], ServerProcess | None] = _reserving_decode,
) -> tuple[threading.Thread, list[Any], ServerProcess]:
    """A request to ``fleet``'s router, in the background, caught mid-transfer (as
    ``caught`` finds it); the decode worker it was caught on."""
    started: list[tuple[threading.Thread, list[Any]]] = []

    def attempt(n: int) -> Callable[[], bool]:
        started.append(_in_background(fleet.router.url, _long_prompt(f"{tag}{n}")))
        return lambda: not started[-1][0].is_alive()

    decode = _catch(attempt, lambda: caught(fleet))
    return (*started[-1], decode)


def test_client_cut_mid_transfer_releases_everything(fleet: Fleet) -> None:
    host, port = fleet.router.url.removeprefix("http://").split(":")
    clients: list[socket.socket] = []

    def attempt(n: int) -> Callable[[], bool]:
        body = orjson.dumps({**GREEDY, "prompt": _long_prompt(f"cut{n}"), "stream": True})
        client = socket.create_connection((host, int(port)))
        clients.append(client)
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # A PD stream's headers leave once the KV is installed: the transfer is over.
        return lambda: bool(select.select([client], [], [], 0)[0])

    try:
        _catch(attempt, lambda: _reserving_decode(fleet))
    finally:
        for client in clients:
            client.close()
    cut_at = time.monotonic()
    assert_at_baseline(fleet)
    # Released when the client left, not when the lease lapsed.
    assert time.monotonic() - cut_at < DEFAULT_LEASE_TTL_S / 3
    assert complete(fleet.router.url, words("after-cut", 100)).status_code == 200


def test_decode_worker_killed_mid_transfer(fleet: Fleet) -> None:
    thread, result, victim = _catch_mid_transfer(fleet, "dkill")
    fleet.killed.add(victim.process.pid)
    victim.kill()
    thread.join(60)
    assert result[0].status_code == 200  # nothing had reached the client: retried elsewhere
    assert_at_baseline(fleet)  # the prefill worker dropped the export when decode vanished
    for tag in ("after-dkill-1", "after-dkill-2"):
        assert complete(fleet.router.url, words(tag, 100)).status_code == 200


def _frozen_before_its_kv_arrived(fleet: Fleet) -> ServerProcess | None:
    """A decode worker reserving for a request whose prefill worker is now stopped
    (SIGSTOP) before the decode worker got its KV: it runs nothing yet. Where the KV had
    arrived (a short transfer done between the poll and the stop, on a loaded box), the
    prefill worker goes on and None is returned: killing it then would find the request
    served remotely, not the fallback this asks for."""
    decode = _reserving_decode(fleet)
    if decode is None:
        return None
    os.killpg(fleet.prefill.process.pid, signal.SIGSTOP)
    time.sleep(0.2)  # bytes sent before the stop land, and are installed
    state = load(decode)
    if state["running"] == 0 and state["free_blocks"] + state["cached_blocks"] < NUM_BLOCKS:
        return decode
    os.killpg(fleet.prefill.process.pid, signal.SIGCONT)
    return None


def test_prefill_worker_killed_mid_request(fleet: Fleet) -> None:
    thread, result, _ = _catch_mid_transfer(fleet, "pkill", _frozen_before_its_kv_arrived)
    fleet.prefill.kill()  # stopped mid-request: the kill finds it there
    thread.join(60)
    assert result[0].status_code == 200  # the decode worker prefilled it itself
    assert_served_by(fleet, result[0], "fallback", prefill_worker=False)
    assert_at_baseline(fleet)
    assert complete(fleet.router.url, words("after-pkill", 100)).status_code == 200
