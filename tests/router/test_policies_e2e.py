"""Each policy routes correctly, through a real router process over real foreign servers
(cache_aware, session and streaming also with ``--processes 2``: one client connection
stays with one process, whose decisions must be the single-process ones)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvserve.router.ports import free_port
from tests.support.processes import ServerProcess, start_router

PREFIX = "You are a meticulous assistant. Answer in one sentence. " * 12


@pytest.fixture
def router_for(foreign_fleet: list[ServerProcess]) -> Iterator:
    started: list[ServerProcess] = []

    def start(policy: str, *options: str) -> httpx.Client:
        urls = [server.url for server in foreign_fleet]
        started.append(start_router(urls, free_port(), "--policy", policy, *options))
        return httpx.Client(base_url=started[-1].url, timeout=10.0)

    yield start
    for router in started:
        router.stop()


def _served_by(client: httpx.Client, body: dict, **kwargs: object) -> tuple[str, str, dict]:
    """(router's worker id, server that really answered, decision) for one request."""
    response = client.post("/v1/completions", json={"max_tokens": 2, **body}, **kwargs)
    assert response.status_code == 200, response.text
    decision = dict(
        part.strip().split("=") for part in response.headers["x-kvserve-decision"].split(";")
    )
    return response.headers["x-kvserve-worker"], response.json()["system_fingerprint"], decision


def test_round_robin_visits_workers_in_turn(router_for) -> None:
    client = router_for("round_robin")
    picks = [_served_by(client, {"prompt": f"question {i}"}) for i in range(6)]
    assert [worker for worker, _, _ in picks] == ["w0", "w1", "w2"] * 2
    assert [server for _, server, _ in picks] == ["A", "B", "C"] * 2
    assert {decision["reason"] for _, _, decision in picks} == {"rotation"}


@pytest.mark.parametrize("policy", ["random", "power_of_two"])
def test_randomized_policies_use_the_whole_fleet(router_for, policy: str) -> None:
    client = router_for(policy, "--seed", "7")
    picks = [_served_by(client, {"prompt": f"q{i}"}) for i in range(24)]
    assert {server for _, server, _ in picks} == {"A", "B", "C"}
    assert {decision["policy"] for _, _, decision in picks} == {policy}


@pytest.mark.parametrize("processes", ["1", "2"])
def test_session_policy_sticks_by_header_or_user(router_for, processes: str) -> None:
    client = router_for("session", "--processes", processes)
    by_header = {
        _served_by(client, {"prompt": f"turn {i}"}, headers={"x-session-id": "conv-1"})[1]
        for i in range(5)
    }
    by_user = {_served_by(client, {"prompt": f"turn {i}", "user": "alice"})[1] for i in range(5)}
    assert len(by_header) == 1 and len(by_user) == 1
    spread = {_served_by(client, {"prompt": "hi", "user": f"user-{i}"})[1] for i in range(30)}
    assert spread == {"A", "B", "C"}
    assert _served_by(client, {"prompt": "anonymous"})[2]["reason"] == "no_session_key"


@pytest.mark.parametrize("processes", ["1", "2"])
def test_cache_aware_follows_prefixes_and_balances_the_rest(router_for, processes: str) -> None:
    client = router_for("cache_aware", "--processes", processes)
    first_worker, first_server, first = _served_by(client, {"prompt": PREFIX + "Q: What is 2+2?"})
    assert first["reason"] == "cache_miss"
    response = client.post(
        "/v1/completions", json={"prompt": PREFIX + "Q: Name a colour.", "max_tokens": 2}
    )
    assert response.headers["x-kvserve-worker"] == first_worker
    assert response.json()["system_fingerprint"] == first_server
    assert "reason=cache_hit" in response.headers["x-kvserve-decision"]
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    unrelated = [_served_by(client, {"prompt": f"{i} unrelated prompt"})[1] for i in range(9)]
    assert Counter(unrelated) == {"A": 3, "B": 3, "C": 3}


@pytest.mark.parametrize("processes", ["1", "2"])
def test_openai_sdk_streams_chat_through_the_router(router_for, processes: str) -> None:
    client = router_for("cache_aware", "--processes", processes)
    sdk = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused")
    stream = sdk.chat.completions.create(
        model="foreign",
        messages=[{"role": "user", "content": "Say x four times."}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " x" * 4
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
