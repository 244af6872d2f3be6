"""Real ``vllm serve`` processes (vLLM's CPU build in .venv-vllm, made by
scripts/setup_vllm.sh) with prefix caching and ZMQ KV events, for tests and benchmarks.

vLLM's CPU attention needs a head width of 32 or more and a block size that is a multiple
of 32: the tiny qwen3 model (head_dim 32) and blocks of 32 tokens fit.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.local_fleet import ServerProcess, StartError
from kvserve.router.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
LAUNCHER = REPO_ROOT / "scripts" / "vllm_serve.py"
BLOCK_SIZE = 32


def require_vllm() -> None:
    """Fail (never skip) when vLLM is not set up: CI runs scripts/setup_vllm.sh first."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh")


class VllmServer:
    """One ``vllm serve`` with KV events on ``events_port`` and replay on ``replay_port``;
    the ports stay the same across :meth:`restart`."""

    def __init__(
        self,
        model_dir: Path,
        *,
        kv_cache_gib: int = 1,
        kv_blocks: int | None = None,
        dev_mode: bool = False,
        single_process: bool = False,
        core: int | None = None,
        compiled: bool = False,
    ) -> None:
        require_vllm()
        self.model_dir = model_dir
        self.dev_mode = dev_mode  # /reset_prefix_cache, for benchmarks
        # vLLM's default runs the engine core and its worker in processes of their own, which
        # busy-poll a shared-memory queue (sched_yield) for a second after each message: on
        # a machine with fewer cores than busy processes that starves everything else for
        # hundreds of milliseconds. True: engine and worker inside the API server's process.
        self.single_process = single_process
        # One CPU of its own (its OpenMP thread bound there), as a GPU worker has its device:
        # without it, every server's steps run on every core and queue behind each other's.
        self.core = core
        # vLLM's default compiles the model (torch.compile) at start-up: half of its ~90 s
        # start on an idle 2-core box. Tests serve it eager; benchmarks as vLLM runs it.
        self.compiled = compiled
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_cache_gib = kv_cache_gib
        # A cache of this many blocks instead of what kv_cache_gib holds (1 GiB is ~250k
        # tokens of the tiny models): a cache that fills, as a GPU server's does.
        self.kv_blocks = kv_blocks
        # vLLM names its ZMQ IPC sockets ipc://<dir>/<uuid4> and leaves them behind (thousands
        # a day in /tmp over test runs): each server gets a directory removed when it stops.
        self.rpc_dir = Path(tempfile.gettempdir()) / f"kvserve-vllm-rpc-{self.port}"
        self.process = self._spawn()

    def _spawn(self) -> ServerProcess:
        self.rpc_dir.mkdir(exist_ok=True)
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv",
        }
        pinned = [] if self.core is None else ["taskset", "-c", str(self.core)]
        args = [
            *pinned, str(VLLM_PYTHON), str(LAUNCHER), str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--max-model-len", "2048", "--enable-prefix-caching",
            "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "16",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        if self.single_process:
            args += ["--distributed-executor-backend", "uni"]
        if not self.compiled:
            args += ["--enforce-eager"]
        if self.kv_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.kv_blocks)]
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind" if self.core is None else str(self.core),
            "PYTHONPATH": "",  # kvserve's source stays out of vLLM's venv
            "VLLM_SERVER_DEV_MODE": "1" if self.dev_mode else "0",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.single_process else "1",
            "VLLM_RPC_BASE_PATH": str(self.rpc_dir),
        }
        self._shared_memory_before = multiprocessing_shared_memory()
        return ServerProcess(args, self.url, name="vllm", env=env)

    def wait_healthy(self, timeout_s: float = 300.0) -> VllmServer:
        try:
            self.process.wait_healthy(timeout_s)
        except StartError as error:
            # vLLM's log ends with the API server's "see root cause above": name that cause.
            log = self.process.log_path.read_text(errors="replace")
            raise StartError(f"{error}\nroot cause: {root_cause(log)}") from error
        return self

    def kill(self) -> None:
        """Die like a crashed server, then remove the shared memory it can no longer remove."""
        self.process.kill()
        unlink_orphans(self._shared_memory_before, self.process.process.pid)
        shutil.rmtree(self.rpc_dir, ignore_errors=True)

    def restart(self) -> VllmServer:
        """A new process on the same ports (not waited for)."""
        self.stop()
        self.process = self._spawn()
        return self

    def stop(self) -> None:
        self.process.stop(30)
        unlink_orphans(self._shared_memory_before, self.process.process.pid)
        shutil.rmtree(self.rpc_dir, ignore_errors=True)

    def counters(self, *names: str) -> dict[str, float]:
        """vLLM's own counters (sample names such as ``vllm:prefix_cache_hits_total``),
        each summed over its labels, from one read of its ``/metrics``; a name it does not
        export is an error."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in names:
                    found[sample.name] = found.get(sample.name, 0.0) + sample.value
        missing = [name for name in names if name not in found]
        if missing:
            raise KeyError(f"{missing} missing from vLLM's /metrics")
        return found

    def kv_events(self, *, replay: bool = True) -> str:
        """This server's event source as the router's ``--kv-events`` takes it."""
        source = f"tcp://127.0.0.1:{self.events_port}"
        return source + (f"?replay=tcp://127.0.0.1:{self.replay_port}" if replay else "")


# A traceback's last line, alone or behind vLLM's "(EngineCore pid=N) ERROR ... ] " prefix.
_EXCEPTION_LINE = re.compile(r"^(?:\(.*?\) ERROR .*?\] )?([\w.]+(?:Error|Exception): .*)$", re.M)


def root_cause(log: str) -> str:
    """The first exception a vLLM process logged (the engine core's, where it failed)."""
    found = _EXCEPTION_LINE.search(log)
    return found.group(1) if found else "no exception in the log"


SHARED_MEMORY = Path("/dev/shm")


def multiprocessing_shared_memory() -> set[Path]:
    """Python multiprocessing's files in /dev/shm: shared memory segments and semaphores."""
    return set(SHARED_MEMORY.glob("psm_*")) | set(SHARED_MEMORY.glob("sem.mp-*"))


def _group_members(group: int) -> list[int]:
    """Live processes of process group ``group`` (a server's engine core and helpers)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            members.append(int(entry.name))
    return members


def _mapped_shared_memory() -> set[Path]:
    """The /dev/shm files some live process maps."""
    mapped = set()
    for entry in Path("/proc").iterdir():
        try:
            lines = (entry / "maps").read_text().splitlines() if entry.name.isdigit() else []
        except OSError:  # ended meanwhile, or not ours to read
            continue
        for line in lines:
            fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
            if len(fields) == 6 and fields[5].startswith(f"{SHARED_MEMORY}/"):
                mapped.add(Path(fields[5]))
    return mapped


def unlink_orphans(before: set[Path], group: int, timeout_s: float = 10.0) -> None:
    """Once process group ``group`` is gone, unlink the multiprocessing files that appeared
    since ``before`` and that no live process maps.

    vLLM's message queues live in POSIX shared memory (``psm_*``, hundreds of MB each), and
    its resource tracker unlinks those and a semaphore only on a graceful exit: a killed
    server leaves them, and over many test runs they fill /dev/shm. A file another server
    made meanwhile is spared while a process maps it (multiprocessing maps what it uses).
    """
    deadline = time.monotonic() + timeout_s
    while _group_members(group) and time.monotonic() < deadline:
        time.sleep(0.05)
    for path in multiprocessing_shared_memory() - before - _mapped_shared_memory():
        path.unlink(missing_ok=True)
