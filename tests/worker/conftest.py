"""The worker shared by this folder's tests: a real process serving a tiny model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.router.local_fleet import ServerProcess
from tests.worker.worker_process import start_worker

# The worker inherits these: two cores are shared by every test process.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), "llama")


@pytest.fixture(scope="session")
def worker(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """One worker for the tests that leave it idle when they finish."""
    server = start_worker(tiny_model_dir)
    yield server
    assert server.stop(timeout_s=30) == 0, server.log_tail()
