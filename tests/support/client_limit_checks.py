"""The client-limit checks that the worker's and the router's tests both run against a
server started with ``LIMIT_FLAGS``."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import orjson

from tests.support.hostile_clients import answer, body_never_ends, stalled, status_of

HEADER_TIMEOUT_S = 3.0
MAX_HEADER_BYTES = 4096
MAX_CONNECTIONS = 50
LIMIT_FLAGS = (
    "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(HEADER_TIMEOUT_S),
    "--max-header-bytes", str(MAX_HEADER_BYTES), "--max-connections", str(MAX_CONNECTIONS),
)  # fmt: skip
STALLED = 40


def stalled_connections_do_not_delay_others(
    url: str, request: Callable[[httpx.Client], httpx.Response], header_closes_with: int | None
) -> None:
    """40 connections that sent half a request: others are served promptly meanwhile, and
    each stalled one is closed at the header deadline (``header_closes_with``: the status
    it is answered with first, None if closed silently)."""
    opened = time.monotonic()
    sockets = [stalled(url) for _ in range(STALLED)]
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(5):
                started = time.monotonic()
                response = request(client)
                assert response.status_code == 200, response.text
                assert time.monotonic() - started < 2.0
        for sock in sockets:
            got = answer(sock, timeout_s=HEADER_TIMEOUT_S + 15)
            if header_closes_with is None:
                assert got == b"", got
            else:
                assert status_of(got) == header_closes_with, got
        assert time.monotonic() - opened >= HEADER_TIMEOUT_S * 0.9  # not closed early
    finally:
        for sock in sockets:
            sock.close()


def a_body_that_never_ends_gets_408(url: str, path: str, headers: str = "") -> None:
    sock = body_never_ends(url, path, headers)
    try:
        got = answer(sock, timeout_s=HEADER_TIMEOUT_S + 15)
    finally:
        sock.close()
    assert status_of(got) == 408, got
    assert orjson.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"


def oversized_headers_get_431(url: str, path: str, headers: dict[str, str]) -> None:
    """One header line over the bound, and many small ones over it together."""
    one_big = {**headers, "x-big": "a" * (MAX_HEADER_BYTES + 1)}
    many = {**headers, **{f"x-h{i}": "b" * 100 for i in range(MAX_HEADER_BYTES // 100)}}
    for sent in (one_big, many):
        response = httpx.get(url + path, headers=sent, timeout=30)
        assert response.status_code == 431, response.text
        error = response.json()["error"]
        assert error["code"] == "headers_too_large" and error["type"] == "invalid_request_error"
    assert httpx.get(url + path, headers=headers, timeout=30).status_code == 200


def connections_past_the_cap_get_503(url: str, path: str, headers: dict[str, str]) -> None:
    sockets = [stalled(url) for _ in range(MAX_CONNECTIONS)]
    try:
        deadline = time.monotonic() + 10
        while True:  # the server has taken all of them in once one more is refused
            response = httpx.get(url + path, headers=headers, timeout=30)
            if response.status_code == 503:
                assert response.json()["error"]["code"] == "too_many_connections"
                break
            assert time.monotonic() < deadline, response.status_code
            time.sleep(0.05)
    finally:
        for sock in sockets:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(url + path, headers=headers, timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "still refused after the connections closed"
        time.sleep(0.05)


def headers_that_never_end_get_431(url: str) -> None:
    """Header bytes past the bound with no end in sight: refused before they end."""
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nx-endless: "
    sock = stalled(url, head + b"a" * (MAX_HEADER_BYTES * 2))
    try:
        got = answer(sock, timeout_s=HEADER_TIMEOUT_S - 1)  # before any header deadline
    finally:
        sock.close()
    assert status_of(got) == 431, got
    assert orjson.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"
