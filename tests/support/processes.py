"""Launching the servers that tests and benchmarks run: the foreign test server and the
kvserve router, as real processes (see :class:`kvserve.router.local_fleet.ServerProcess`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess

__all__ = ["ServerProcess", "start_foreign_server", "start_router"]

REPO_ROOT = Path(__file__).resolve().parents[2]
FOREIGN_SERVER = REPO_ROOT / "tests" / "support" / "foreign_openai_server.py"


def start_foreign_server(
    name: str, port: int, *, ttft_s: float = 0.0, token_delay_s: float = 0.0
) -> ServerProcess:
    """The test's own OpenAI-compatible server (not kvserve), healthy on return."""
    args = [sys.executable, str(FOREIGN_SERVER), "--port", str(port), "--name", name]
    args += ["--ttft", str(ttft_s), "--token-delay", str(token_delay_s)]
    return ServerProcess(args, f"http://127.0.0.1:{port}", name=f"foreign-{name}").wait_healthy()


def start_router(
    worker_urls: Sequence[str], port: int, *options: str, ready_path: str = "/health"
) -> ServerProcess:
    """``kvserve router`` over ``worker_urls``, answering 200 on ``ready_path`` on return
    (``/health``: some worker is up; ``/metrics``: the router itself is)."""
    args = [
        *KVSERVE_COMMAND,
        "router",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        *options,
    ]
    return ServerProcess(args, f"http://127.0.0.1:{port}", name="router").wait_healthy(
        path=ready_path
    )
