"""Launching the servers that tests and benchmarks run: the foreign test server and the
kvserve router, as real processes (see :class:`kvserve.router.local_fleet.ServerProcess`).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess

__all__ = ["ServerProcess", "router_processes", "start_foreign_server", "start_router"]

REPO_ROOT = Path(__file__).resolve().parents[2]
FOREIGN_SERVER = REPO_ROOT / "tests" / "support" / "foreign_openai_server.py"

# Options every router a test starts gets, so that the same tests check each process mode
# the router offers (``scripts/test_router_modes.sh`` sets it, e.g. "--processes 2").
ROUTER_MODE_OPTIONS = tuple(shlex.split(os.environ.get("KVSERVE_TEST_ROUTER_OPTIONS", "")))
# What a mode's option refuses beside it (``RouterConfig`` says why): such a test is
# skipped in that mode, with the reason, rather than run in another mode under its name.
_REFUSED_BESIDE = {"--processes": ("--peers",)}


def router_processes(options: Sequence[str] = ()) -> int:
    """How many processes a router started with ``options`` runs, in this mode."""
    chosen = [*ROUTER_MODE_OPTIONS, *options]
    at = max((i for i, option in enumerate(chosen) if option == "--processes"), default=None)
    return 1 if at is None else int(chosen[at + 1])


def _skip_where_the_mode_does_not_apply(options: Sequence[str]) -> None:
    """Skip a router the mode cannot start, or that it would not change (the test sets
    every option of the mode itself: the main run has already run it as it is)."""
    mode_names = [option for option in ROUTER_MODE_OPTIONS if option.startswith("--")]
    if mode_names and all(name in options for name in mode_names):
        pytest.skip(f"the test sets {' '.join(mode_names)} itself (run as it is by the main run)")
    for mode_option, refused in _REFUSED_BESIDE.items():
        clash = [option for option in refused if option in options]
        if mode_option in ROUTER_MODE_OPTIONS and clash:
            pytest.skip(f"the router refuses {mode_option} beside {', '.join(clash)}")


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
    _skip_where_the_mode_does_not_apply(options)
    args = [
        *KVSERVE_COMMAND,
        "router",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        *ROUTER_MODE_OPTIONS,  # first: a test's own choice of the same option wins
        *options,
    ]
    return ServerProcess(args, f"http://127.0.0.1:{port}", name="router").wait_healthy(
        path=ready_path
    )
