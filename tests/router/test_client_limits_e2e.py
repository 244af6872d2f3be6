"""The router's limits on slow, stalled and greedy clients, on a real router process in
front of a real (foreign) OpenAI server."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvserve.router.local_fleet import ServerProcess
from kvserve.router.ports import free_port
from tests.support import client_limit_checks as checks
from tests.support.processes import start_foreign_server, start_router


@pytest.fixture(scope="module")
def router() -> Iterator[ServerProcess]:
    backend = start_foreign_server("A", free_port())
    try:
        server = start_router([backend.url], free_port(), *checks.LIMIT_FLAGS)
        yield server
        server.stop()
    finally:
        backend.stop()


def complete(client: httpx.Client) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})


def test_stalled_connections_do_not_delay_others_and_are_closed(router: ServerProcess) -> None:
    checks.stalled_connections_do_not_delay_others(router.url, complete, header_closes_with=None)


def test_a_body_that_never_ends_gets_408(router: ServerProcess) -> None:
    checks.a_body_that_never_ends_gets_408(router.url, "/v1/completions")


def test_oversized_headers_get_431(router: ServerProcess) -> None:
    checks.oversized_headers_get_431(router.url, "/health", {})


def test_connections_past_the_cap_get_503(router: ServerProcess) -> None:
    checks.connections_past_the_cap_get_503(router.url, "/health", {})


def test_headers_that_never_end_get_431(router: ServerProcess) -> None:
    checks.headers_that_never_end_get_431(router.url)
