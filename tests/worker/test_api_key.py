"""``--api-key`` guards every worker route but ``/health``; ``--metrics-without-key``
opens ``/metrics`` and nothing else; a PD decode worker sends the key to its prefill peer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.router.local_fleet import ServerProcess
from tests.worker.worker_process import API_KEY, AUTH, served_model, start_worker

MISSING: dict[str, str] = {}
WRONG = {"authorization": "Bearer not-the-key"}
BARE_KEY = {"authorization": API_KEY}  # the key without "Bearer "


def _protected(worker: ServerProcess) -> list[tuple[str, str, dict[str, object] | None]]:
    completion = {"model": served_model(worker), "prompt": "hello", "max_tokens": 2}
    return [
        ("POST", "/v1/completions", completion),
        ("GET", "/v1/models", None),
        ("GET", "/load", None),
        ("GET", "/metrics", None),
        ("GET", "/kv/events", None),
        ("GET", "/kv/snapshot", None),
        ("GET", "/debug/check", None),
    ]


def _call(
    url: str, method: str, path: str, body: dict[str, object] | None, headers: dict[str, str]
) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60.0)


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.json() == {
        "error": {
            "message": "Invalid or missing API key.",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


def test_every_route_but_health_needs_the_key(worker: ServerProcess) -> None:
    for method, path, body in _protected(worker):
        for headers in (MISSING, WRONG, BARE_KEY):
            assert_refused(_call(worker.url, method, path, body, headers))
        accepted = _call(worker.url, method, path, body, AUTH)
        assert accepted.status_code == 200, (path, accepted.text)
    assert httpx.get(worker.url + "/health").status_code == 200


@pytest.fixture(scope="module")
def metrics_open_worker(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    server = start_worker(tiny_model_dir, "--metrics-without-key")
    yield server
    assert server.stop(timeout_s=30) == 0, server.log_tail()


def test_metrics_without_key_opens_metrics_only(metrics_open_worker: ServerProcess) -> None:
    url = metrics_open_worker.url
    assert httpx.get(url + "/metrics").status_code == 200
    assert "kvserve" in httpx.get(url + "/metrics").text
    for method, path, body in _protected(metrics_open_worker):
        if path != "/metrics":
            assert_refused(_call(url, method, path, body, MISSING))


@pytest.fixture(scope="module")
def pd_pair(tiny_model_dir: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    prefill = start_worker(tiny_model_dir, "--role", "prefill")
    try:
        decode = start_worker(tiny_model_dir, "--role", "decode", "--pd-min-remote-tokens", "1")
        try:
            yield prefill, decode
        finally:
            assert decode.stop(timeout_s=30) == 0, decode.log_tail()
    finally:
        assert prefill.stop(timeout_s=30) == 0, prefill.log_tail()


def test_pd_routes_need_the_key_and_decode_sends_it(
    pd_pair: tuple[ServerProcess, ServerProcess],
) -> None:
    prefill, decode = pd_pair
    body = {"model": served_model(decode), "prompt": "a b c d e f g h " * 8, "max_tokens": 2}
    via_prefill = {"x-kvserve-prefill": prefill.url}
    for headers in (MISSING, WRONG):
        assert_refused(httpx.get(prefill.url + "/pd/info", headers=headers))
        refused = _call(decode.url, "POST", "/pd/v1/completions", body, headers | via_prefill)
        assert_refused(refused)
    assert httpx.get(prefill.url + "/pd/info", headers=AUTH).json()["role"] == "prefill"
    served = _call(decode.url, "POST", "/pd/v1/completions", body, AUTH | via_prefill)
    assert served.status_code == 200, served.text
    assert served.headers["x-kvserve-pd"] == "remote"  # the decode worker read /pd/info
