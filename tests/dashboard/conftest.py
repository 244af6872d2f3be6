"""A live fleet for the operators' view: two real kvserve workers on a tiny model, each
with a host KV tier (so tier figures exist), behind a router with an admin key."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvserve.router.local_fleet import ServerProcess
from kvserve.router.ports import free_port
from tests.support.processes import start_router
from tests.worker.worker_process import API_KEY, start_worker

os.environ.setdefault("OMP_NUM_THREADS", "1")  # two cores are shared by every test process

ADMIN_KEY = "admin-key"
HOST_CACHE_BLOCKS = 64


@dataclass(frozen=True)
class Fleet:
    router: ServerProcess
    workers: list[ServerProcess]  # in registration order: w0, w1


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from kvserve.engine.tiny_model import make_tiny_model

    model_dir: Path = make_tiny_model(tmp_path_factory.mktemp("tiny-model"), "llama")
    workers: list[ServerProcess] = []
    try:
        for _ in range(2):
            workers.append(start_worker(model_dir, "--host-cache-blocks", str(HOST_CACHE_BLOCKS)))
        options = [
            "--admin-api-key",
            ADMIN_KEY,
            "--policy",
            "cache_aware",
            "--worker-api-key",
            API_KEY,
        ]
        with start_router([w.url for w in workers], free_port(), *options) as router:
            yield Fleet(router, workers)
    finally:
        for worker in workers:
            worker.stop(timeout_s=30)
