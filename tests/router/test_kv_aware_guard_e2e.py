"""kv_aware's load guard holds only the prefill work the policy predicts: the prompt less
what the worker is predicted to hold, as the router's load gauge shows until the first
token. One cost-model worker with a small step budget, so a prefill lasts long enough to
be seen. A client that leaves while its prompt is being tokenized leaves nothing held."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port
from tests.support.metrics_text import by_label, samples, wait_until_indexed
from tests.support.processes import start_router

PREFILL_GAUGE = "kvserve_router_in_flight_prefill_tokens"
REQUESTS_GAUGE = "kvserve_router_in_flight_requests"
DECISIONS = "kvserve_router_decisions_total"
SHARED = "Shared context about harbours, tides and ships. " * 20
CHARS_PER_TOKEN = 4  # the router's default estimate


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from kvserve.engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path_factory.mktemp("kv-guard-model"), "llama")
    port = free_port()
    args = [
        *KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port),
        "--runner", "sim", "--sim-profile", "llama3-8b-h100", "--num-blocks", "256",
        "--max-num-batched-tokens", "8", "--served-model-name", str(model_dir),
    ]  # fmt: skip
    worker = ServerProcess(args, f"http://127.0.0.1:{port}", name="sim-worker")
    try:
        worker.wait_healthy(90)
        with start_router([worker.url], free_port(), "--policy", "kv_aware") as process:
            yield process
    finally:
        worker.stop()


def held_prefill_tokens(router: ServerProcess) -> float:
    return sum(by_label(samples(router.url + "/metrics"), PREFILL_GAUGE, "worker").values())


def first_held_value(router: ServerProcess, within_s: float) -> float:
    """The gauge's value as soon as some guard holds prefill tokens."""
    deadline = time.monotonic() + within_s
    while (held := held_prefill_tokens(router)) == 0:
        assert time.monotonic() < deadline, "no prefill tokens were ever held"
        time.sleep(0.005)
    return held


def complete(router: ServerProcess, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    response = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response


def test_guard_holds_the_predicted_uncached_tokens_until_the_first_token(
    router: ServerProcess,
) -> None:
    model = httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    complete(router, model, SHARED)
    wait_until_indexed(router.url)  # the worker's own events reached the router
    time.sleep(2.5)  # a timer, not a sync: the speculative TTL (2 s) has lapsed after it
    prompt = SHARED + " ".join(f"novel{i}" for i in range(120))
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(complete, router, model, prompt)
        held = first_held_value(router, within_s=10)
        decision = pending.result().headers["x-kvserve-decision"]
    assert "reason=cache_hit" in decision, decision
    matched = float(decision.split("matched=")[1])  # the header rounds it to 3 places
    estimate = round(len(prompt) / CHARS_PER_TOKEN)
    assert 0.3 < matched < 0.9
    assert abs(held - estimate * (1 - matched)) <= 1
    assert held_prefill_tokens(router) == 0  # released with the answer


def total(router: ServerProcess, name: str, label: str = "worker") -> float:
    return sum(by_label(samples(router.url + "/metrics"), name, label).values())


def test_a_client_leaving_during_tokenization_leaves_nothing_held(router: ServerProcess) -> None:
    model = httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    deadline = time.monotonic() + 10
    while "no_tokenizer" in complete(router, model, "hello").headers["x-kvserve-decision"]:
        assert time.monotonic() < deadline, "the router never learned the block size"
        time.sleep(0.1)
    decisions = total(router, DECISIONS, "reason")
    long_body = {"model": model, "prompt": "Shared context about tides. " * 40_000, "max_tokens": 1}
    with pytest.raises(httpx.TimeoutException):  # gone while the router tokenizes (~1 s)
        httpx.post(router.url + "/v1/completions", json=long_body, timeout=0.2)
    # Nothing observable marks an abandoned handler's end: wait past when its tokenizing
    # (~1 s) would have ended, had it gone on, and check that it never routed.
    time.sleep(2)
    complete(router, model, "after")
    assert total(router, DECISIONS, "reason") == decisions + 1  # the abandoned one: never routed
    assert total(router, REQUESTS_GAUGE) == 0
    assert total(router, PREFILL_GAUGE) == 0


def stream_chat(router: ServerProcess, model: str, text: str) -> list[str]:
    """The SSE data lines of a streamed chat answer, in order."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line.startswith("data:")]


def test_a_chat_stream_holds_its_prefill_load_until_the_prompt_is_computed(
    router: ServerProcess,
) -> None:
    """The role chunk once went out before prefill started, and the router, which lets go
    of prefill load at a stream's first byte, released it while the worker still prefilled."""
    model = httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    (worker,) = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    text = " ".join(f"fresh{i} words about the sea" for i in range(60))
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(stream_chat, router, model, text)
        first_held_value(router, within_s=30)
        while held_prefill_tokens(router) > 0 and not pending.done():
            time.sleep(0.002)
        # Released: by then the worker must have computed the prompt (nothing left to
        # prefill), unless the whole answer is already over.
        worker_load = httpx.get(worker["url"] + "/load", timeout=10).json()
        lines = pending.result()
    assert worker_load["prefill_tokens"] == 0, worker_load
    assert '"role":"assistant"' in lines[0] and lines[-1] == "data: [DONE]"
    assert any('"content":"' in line and '"content":""' not in line for line in lines[1:])


def test_a_non_streamed_request_releases_its_prefill_load_at_the_first_token(
    router: ServerProcess,
) -> None:
    """The worker sends a non-streamed answer's headers with its first token: the router
    lets go of the prefill load then, not when the whole answer (a long decode) is in."""
    model = httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    (worker,) = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    prompt = " ".join(f"unseen{i} words about rivers" for i in range(60))
    body = {"model": model, "prompt": prompt, "max_tokens": 400, "ignore_eos": True}

    def send() -> httpx.Response:
        return httpx.post(router.url + "/v1/completions", json=body, timeout=120)

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(send)
        first_held_value(router, within_s=30)
        deadline = time.monotonic() + 60
        while held_prefill_tokens(router) > 0:
            assert time.monotonic() < deadline, "prefill load never released"
            time.sleep(0.002)
        worker_load = httpx.get(worker["url"] + "/load", timeout=10).json()
        requests_held = total(router, REQUESTS_GAUGE)
        answered_by_then = pending.done()
        response = pending.result()
    assert not answered_by_then and requests_held == 1  # released mid-answer
    assert worker_load["prefill_tokens"] == 0 and worker_load["running"] == 1, worker_load
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 400
    assert total(router, REQUESTS_GAUGE) == 0
