"""Server processes on this machine: started, waited on until healthy, and stopped for sure.

``kvserve up`` runs a fleet of workers and a router this way, and the tests and benchmarks
use the same class. Each process gets its own session (so a terminal's Ctrl-C reaches only
the supervisor, which then stops children in order) and writes to a log file (a pipe that
nobody reads would block a chatty server); the log's tail is shown when a start fails.

A supervisor killed outright (SIGKILL, the OOM killer) cannot stop its children, so on
Linux each child asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``).
The kernel ties that to the *thread* that started the child: start servers from a thread
that outlives them (the main thread, as ``kvserve up`` and the tests do).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvserve.router.ports import free_port
from kvserve.router.restart_backoff import RestartBackoff, RestartPlan, RestartPolicy

KVSERVE_COMMAND = (sys.executable, "-c", "from kvserve.cli import main; main()")


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _terminate_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent SIGTERM when this process dies; None where
    the platform cannot (the child then outlives a killed parent, as before)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) == 0 and os.getppid() != parent:
            os._exit(1)  # the parent died before the request took effect: nobody to serve

    return set_parent_death_signal


# A local fleet's workers are on loopback, where a health check costs next to nothing and
# a healthy worker answers in milliseconds: checking every 2 s (not the router's default
# 60 s) with a 2 s timeout (not 5 s) notices a dead, hung or restarted worker in seconds.
_LOCAL_HEALTH_CHECKS = ("--health-check-interval", "2", "--health-check-timeout", "2")
_RESTARTS = RestartPolicy()


class StartError(RuntimeError):
    """A process exited or stayed unhealthy while starting."""


class ServerProcess:
    """A server started in its own session, answering on ``url``."""

    def __init__(
        self,
        args: Sequence[str],
        url: str,
        *,
        name: str = "server",
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        append_log: bool = False,
    ) -> None:
        self.args = list(args)
        self.url = url
        self.name = name
        if log_path is None:
            handle, raw_path = tempfile.mkstemp(prefix=f"kvserve-{name}-", suffix=".log")
            os.close(handle)
            log_path = Path(raw_path)
        self.log_path = log_path
        self._env = env
        self._cwd = cwd
        with self.log_path.open("ab" if append_log else "wb") as log:
            self.process = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else {**os.environ, **env},
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_terminate_with_parent(),
            )
        self.started_at = time.monotonic()

    def respawn(self) -> ServerProcess:
        """The same server started again (same command, URL and log, which it appends to,
        so the log of the run that died stays readable)."""
        return ServerProcess(
            self.args,
            self.url,
            name=self.name,
            log_path=self.log_path,
            env=self._env,
            cwd=self._cwd,
            append_log=True,
        )

    def exit_reason(self) -> str:
        """How the process ended, e.g. ``killed by SIGKILL`` or ``exit code 1``."""
        code = self.process.returncode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_healthy(self, timeout_s: float = 30.0, path: str = "/health") -> ServerProcess:
        """Poll ``path`` until it answers 200; stop the process and raise if it dies or stalls."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise StartError(f"{self.name} exited while starting:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2.0) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        self.stop()
        raise StartError(f"{self.name} not healthy after {timeout_s}s:\n{self.log_tail()}")

    def kill(self) -> None:
        """Die like a crashed server: no graceful shutdown."""
        self._signal(signal.SIGKILL)
        self.process.wait()

    def terminate(self) -> None:
        """Ask for a graceful stop without waiting for it."""
        self._signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM (a graceful stop), then SIGKILL after ``timeout_s``; the exit code."""
        if self.alive():
            self.terminate()
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


class LocalFleet:
    """Workers and a router on this machine, started in order and stopped in reverse.

    Workers share the CPU, so each gets ``cpus / workers`` threads unless the caller's
    environment sets ``OMP_NUM_THREADS``. With ``routers`` R > 1, R router replicas serve
    on ports ``port`` … ``port + R - 1``, each with the others as ``--peers``; clients
    spread their requests over the listed URLs (no shared port: a peer must be reachable
    at its own address).
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        workers: int,
        policy: str,
        host: str,
        port: int,
        log_dir: Path,
        prefill: int = 0,
        decode: int = 0,
        worker_args: Sequence[str] = (),
        router_args: Sequence[str] = (),
        api_key: str | None = None,
        routers: int = 1,
    ) -> None:
        if routers < 1:
            raise ValueError("a fleet needs at least one router")
        if prefill and not decode:
            raise ValueError("prefill workers need decode workers")
        # PD mode (decode > 0): prefill and decode workers instead of mixed ones.
        self._roles = ["prefill"] * prefill + ["decode"] * decode if decode else ["mixed"] * workers
        if not self._roles:
            raise ValueError("a fleet needs at least one worker")
        self._model_dir = model_dir
        self._worker_args = list(worker_args)  # ``kvserve worker`` flags every worker gets
        self._router_args = list(router_args)  # and ``kvserve router`` flags the router gets
        self._workers = len(self._roles)
        self._policy = policy
        self._api_key = api_key  # one key for the router's clients, the router and the workers
        self._host = host
        self._port = port
        self._routers = routers
        self.log_dir = log_dir
        self.processes: list[ServerProcess] = []  # replaced in place when restarted

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._port}"

    @property
    def router_urls(self) -> list[str]:
        """Every router replica's URL, ``url`` first."""
        return [f"http://{self._host}:{self._port + i}" for i in range(self._routers)]

    def start(self, timeout_s: float = 180.0) -> None:
        """Start every worker, wait until all are healthy, then the router; all or nothing."""
        threads = str(max(1, (os.cpu_count() or 1) // self._workers))
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
        try:
            workers = []
            for index, role in enumerate(self._roles):
                port = free_port()
                args = [*KVSERVE_COMMAND, "worker", "--model", str(self._model_dir)]
                args += ["--host", "127.0.0.1", "--port", str(port), "--role", role]
                args += self._worker_args
                if self._api_key is not None:
                    args += ["--api-key", self._api_key]
                workers.append(self._spawn(f"worker{index}", args, f"http://127.0.0.1:{port}", env))
            for worker in workers:
                worker.wait_healthy(timeout_s)
            args = [*KVSERVE_COMMAND, "router", "--policy", self._policy, "--host", self._host]
            args += [*_LOCAL_HEALTH_CHECKS, *self._router_args]
            if self._api_key is not None:
                args += ["--api-key", self._api_key, "--worker-api-key", self._api_key]
            if self._policy == "kv_aware":  # workers serve a model name, not the folder
                args += ["--tokenizer", str(self._model_dir)]
            for worker, role in zip(workers, self._roles, strict=True):
                args += ["--worker-urls" if role == "mixed" else f"--{role}", worker.url]
            urls = self.router_urls
            routers = []
            for index, url in enumerate(urls):
                own = [*args, "--port", str(self._port + index)]
                own += [arg for peer in urls if peer != url for arg in ("--peers", peer)]
                routers.append(self._spawn(_router_name(index), own, url, env))
            for router in routers:
                router.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def supervise(
        self,
        report: Callable[[str], None],
        policy: RestartPolicy = _RESTARTS,
        poll_s: float = 0.1,
    ) -> ServerProcess:
        """Keep the workers running until the router exits; return the router.

        A worker that exits is started again on its own port after the backoff of
        :class:`RestartBackoff` (the router's health checks readmit it once it answers);
        each exit, restart and crash loop is reported. Interrupt it (Ctrl-C, SIGTERM) to
        stop; then call :meth:`stop`.
        """
        backoffs = {
            p.name: RestartBackoff(policy) for p in self.processes if not _is_router(p.name)
        }
        due: dict[str, tuple[float, ServerProcess]] = {}  # dead workers and when to restart
        while True:
            now = time.monotonic()
            for index, process in enumerate(self.processes):
                if _is_router(process.name):
                    if not process.alive():
                        return process
                    continue
                if process.name in due:
                    restart_at, dead = due[process.name]
                    if now >= restart_at:
                        del due[process.name]
                        self.processes[index] = dead.respawn()
                        report(self.started_line(self.processes[index]))
                    continue
                if not process.alive():
                    plan = backoffs[process.name].on_exit(now - process.started_at)
                    due[process.name] = (now + plan.delay_s, process)
                    report(_exit_report(process, plan))
            time.sleep(poll_s)

    def started_line(self, process: ServerProcess) -> str:
        """Where a process runs, for the operator (and for ``kill``)."""
        return f"{process.name} started (pid {process.process.pid}) on {process.url}"

    def stop(self, timeout_s: float = 15.0) -> None:
        """The routers first (no new requests), then all workers at once."""
        routers = [p for p in self.processes if _is_router(p.name)]
        for process in routers:
            process.stop(timeout_s)
        workers = [p for p in self.processes if not _is_router(p.name)]
        for process in workers:
            process.terminate()
        for process in workers:
            process.stop(timeout_s)

    def _spawn(self, name: str, args: list[str], url: str, env: Mapping[str, str]) -> ServerProcess:
        process = ServerProcess(
            args, url, name=name, log_path=self.log_dir / f"{name}.log", env=env
        )
        self.processes.append(process)
        return process


def _router_name(index: int) -> str:
    return "router" if index == 0 else f"router{index}"


def _is_router(name: str) -> bool:
    return name.startswith("router")


def _exit_report(process: ServerProcess, plan: RestartPlan) -> str:
    """One line per death; a crash loop's also carries the log's tail, each time."""
    line = (
        f"{process.name} exited ({process.exit_reason()}); restart {plan.restarts} "
        f"in {plan.delay_s:.1f}s on {process.url}"
    )
    if not plan.crash_loop:
        return line
    return (
        f"{line}\n{process.name} is crash-looping ({plan.quick_deaths} quick exits in a row); "
        f"its log ({process.log_path}) ends:\n{process.log_tail()}"
    )
