"""Router tests import the shared process helpers from ``tests/support``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from kvserve.router.ports import free_port  # noqa: E402
from tests.support.processes import ServerProcess, start_foreign_server  # noqa: E402


@pytest.fixture(scope="module")
def foreign_fleet() -> Iterator[list[ServerProcess]]:
    """Three foreign OpenAI-compatible servers, A, B and C."""
    servers: list[ServerProcess] = []
    try:
        for name in "ABC":
            servers.append(start_foreign_server(name, free_port()))
        yield servers
    finally:
        for server in servers:
            server.stop()
