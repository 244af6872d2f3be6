"""The worker's limits on slow, stalled and greedy clients, on a real worker process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.router.local_fleet import ServerProcess
from tests.support import client_limit_checks as checks
from tests.worker.worker_process import AUTH, served_model, start_worker

AUTH_LINE = "".join(f"{k}: {v}\r\n" for k, v in AUTH.items())


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    server = start_worker(tiny_model_dir, *checks.LIMIT_FLAGS)
    yield server
    server.stop()


def test_stalled_connections_do_not_delay_others_and_get_408(guarded: ServerProcess) -> None:
    body = {"model": served_model(guarded), "prompt": "Hello", "max_tokens": 2}

    def complete(client: httpx.Client) -> httpx.Response:
        return client.post("/v1/completions", json=body, headers=AUTH)

    checks.stalled_connections_do_not_delay_others(guarded.url, complete, header_closes_with=408)


def test_a_body_that_never_ends_gets_408(guarded: ServerProcess) -> None:
    checks.a_body_that_never_ends_gets_408(guarded.url, "/v1/completions", AUTH_LINE)


def test_oversized_headers_get_431(guarded: ServerProcess) -> None:
    checks.oversized_headers_get_431(guarded.url, "/load", AUTH)


def test_connections_past_the_cap_get_503(guarded: ServerProcess) -> None:
    checks.connections_past_the_cap_get_503(guarded.url, "/load", AUTH)


def test_headers_that_never_end_get_431(guarded: ServerProcess) -> None:
    checks.headers_that_never_end_get_431(guarded.url)
