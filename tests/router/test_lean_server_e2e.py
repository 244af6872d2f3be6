"""What only the lean HTTP server (``--http-server lean``) has to get right: the hand-off
to the aiohttp app (per connection, and per request on a lean connection), the client's
address across it, and HTTP framing it parses itself. The rest of the router's behaviour
is checked under it by running tests/router with ``KVSERVE_ROUTER_HTTP_SERVER=lean``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest

from kvserve.router.ports import free_port
from tests.support.processes import ServerProcess, start_router

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture(scope="module")
def router(foreign_fleet: list[ServerProcess]) -> Iterator[ServerProcess]:
    urls = [server.url for server in foreign_fleet]
    options = ("--policy", "cache_aware", "--http-server", "lean")
    with start_router(urls, free_port(), *options) as process:
        yield process


def test_one_keep_alive_connection_mixes_hot_and_other_routes(router: ServerProcess) -> None:
    with httpx.Client(base_url=router.url, timeout=10) as client:
        first = client.post("/v1/chat/completions", json=CHAT)
        models = client.get("/v1/models")  # forwarded alone to the aiohttp app
        workers = client.get("/workers")  # loopback client: allowed without a key
        again = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert first.status_code == 200 and first.headers["x-kvserve-worker"]
    assert first.json()["choices"]
    assert models.status_code == 200 and "data" in models.json()
    assert workers.status_code == 200 and len(workers.json()["workers"]) == 3
    assert again.status_code == 200 and again.json()["choices"]


def test_a_connection_opened_by_another_route_is_served_by_aiohttp(
    router: ServerProcess,
) -> None:
    with httpx.Client(base_url=router.url, timeout=10) as client:
        assert client.get("/health").json()["healthy_workers"] == 3
        answer = client.post("/v1/chat/completions", json=CHAT)  # spliced: aiohttp answers
        assert answer.status_code == 200 and answer.headers["x-kvserve-worker"]


def _raw(router: ServerProcess, request: bytes) -> bytes:
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_a_chunked_request_body_is_read_whole(router: ServerProcess) -> None:
    body = orjson.dumps(CHAT)
    half = len(body) // 2
    chunks = b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (
        half,
        body[:half],
        len(body) - half,
        body[half:],
    )
    got = _raw(
        router,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n" + chunks,
    )
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]


def test_bad_json_and_malformed_http_get_openai_errors(router: ServerProcess) -> None:
    bad = httpx.post(router.url + "/v1/completions", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    got = _raw(router, b"POST /v1/completions HTTP/1.1\r\nContent-Length: nope\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 400 "), got[:200]
    assert orjson.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"


def test_streams_are_relayed_chunked_to_the_end(router: ServerProcess) -> None:
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
