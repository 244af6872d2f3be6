"""``kvserve up`` as a test runs it: a real process, healthy and announced on return, and
the workers' process ids as its log names them (to kill or stop one)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port


def start_up(cache_dir: Path, *options: str) -> ServerProcess:
    port = free_port()
    process = ServerProcess(
        [*KVSERVE_COMMAND, "up", "--port", str(port), *options],
        f"http://127.0.0.1:{port}",
        name="up",
        env={"KVSERVE_CACHE_DIR": str(cache_dir)},
    )
    process.wait_healthy(timeout_s=180)
    # The first router may answer before the rest of the fleet (other router replicas) is.
    deadline = time.monotonic() + 90
    while "kvserve is up" not in process.log_tail():
        assert time.monotonic() < deadline, process.log_tail()
        time.sleep(0.05)
    return process


def worker_pids(up: ServerProcess, name: str) -> list[int]:
    """Every pid ``up`` has started ``name`` with, oldest first."""
    log = up.log_path.read_text(errors="replace")
    return [int(pid) for pid in re.findall(rf"^{name} started \(pid (\d+)\)", log, re.MULTILINE)]
