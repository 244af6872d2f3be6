"""Launching real server processes for tests and benchmarks, and stopping them for sure.

Output goes to a log file (a pipe nobody reads would block a chatty server), and the log
is shown when a process fails to come up, which is when it is needed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
KVSERVE = (sys.executable, "-c", "from kvserve.cli import main; main()")


class ServerProcess:
    """A server started in its own process group, on a known URL."""

    def __init__(self, args: Sequence[str], url: str, *, name: str = "server") -> None:
        self.args = list(args)
        self.url = url
        self.name = name
        self.log_path = Path(tempfile.mkstemp(prefix=f"kvserve-{name}-", suffix=".log")[1])
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                start_new_session=True,
            )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = 30.0, path: str = "/health") -> ServerProcess:
        """Poll ``path`` until it answers 200; fail with the log if the process dies or stalls."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.log_text()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2.0) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.name} not healthy after {timeout_s}s:\n{self.log_text()}")

    def kill(self) -> None:
        """Die like a crashed server: no graceful shutdown."""
        self._signal(signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.process.pid, signum)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


FOREIGN_SERVER = REPO_ROOT / "tests" / "support" / "foreign_openai_server.py"


def start_foreign_server(
    name: str, port: int, *, ttft_s: float = 0.0, token_delay_s: float = 0.0
) -> ServerProcess:
    """The test's own OpenAI-compatible server (not kvserve), healthy on return."""
    args = [sys.executable, str(FOREIGN_SERVER), "--port", str(port), "--name", name]
    args += ["--ttft", str(ttft_s), "--token-delay", str(token_delay_s)]
    return ServerProcess(args, f"http://127.0.0.1:{port}", name=f"foreign-{name}").wait_healthy()


def start_router(worker_urls: Sequence[str], port: int, *options: str) -> ServerProcess:
    """``kvserve router`` over ``worker_urls``, healthy (some worker up) on return."""
    args = [*KVSERVE, "router", "--port", str(port), "--worker-urls", *worker_urls, *options]
    return ServerProcess(args, f"http://127.0.0.1:{port}", name="router").wait_healthy()
