"""A real ``redis-server`` on a free loopback port, for the storage tier's tests.

``.ci/run`` installs redis-server when it is missing; where it still is, the tests that
need it fail with that reason (never skipped, never faked).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvserve.router.ports import free_port

REDIS_SERVER = shutil.which("redis-server")
_START_TIMEOUT_S = 10.0


class RedisServer:
    """One server process in its own directory, with no persistence: a kill loses
    everything, as a crashed cache server would."""

    def __init__(self, directory: Path) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed")
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        """Start (or restart, on the same port) and wait until it answers PING."""
        assert REDIS_SERVER is not None
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.directory), "--save", "", "--appendonly", "no"]
        log = (self.directory / "redis.log").open("ab")
        self._process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
            finally:
                client.close()

    def kill(self) -> None:
        """SIGKILL: no goodbye to connected clients."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A started server, killed after the test."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server is not installed (.ci/run installs it with apt-get)")
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.kill()
