"""How long a CPU engine's threads spin between ops: through a step while the cores are
the engine's alone, hardly at all while other jobs want them.

A step is a hundred-odd parallel ops back to back. Between two of them torch's OpenMP
threads (libgomp) spin for ``GOMP_SPINCOUNT`` iterations, then sleep; waking a sleeping
sibling costs more than the op's split saves (on the 2-core dev VM about 140 µs a wake:
~3,900 wakes a round of the shared-prefix benchmark with short spins, which made two
threads 10-25 % slower than with long ones). Spinning is right on cores the engine has
to itself and wrong on cores shared with other busy jobs: a spinning sibling uses up its
share of the core while the thread with the op's work waits for a CPU.

libgomp reads its spin count once, but cuts every thread's spin to 100 while it manages
more OpenMP threads than the process has CPUs (its documented "throttled" wait). So the
engine spins long (``kvserve.engine`` sets the count) and, while its cores are shared,
:class:`SpinThrottle` parks an idle pool of OpenMP threads on a thread of its own, which
puts libgomp over that line; releasing the pool restores the long spin. The engine keeps
all its threads either way.

:class:`ThreadGovernor` decides from what Linux counts anyway: the time this process's
threads spent runnable but waiting for a CPU (``run_delay`` in
``/proc/<pid>/task/<tid>/schedstat``), over windows of ``window_s`` spent inside forwards
(however sparse the steps; between them the threads sleep and wait for nothing). Beyond
``wait_share`` of the threads' time, the cores are shared: short waits. Below it for a
window, they are free again: long waits. Each time that proves wrong (shared again
within one window) the windows in a row needed double, up to ``MAX_FREE_WINDOWS``, so
that a job that comes and goes is not spun against every other window.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.engine import GOVERNED_SPINCOUNT
from kvserve.engine.device import OMP_PAUSE_SOFT, loaded_libgomp

MAX_FREE_WINDOWS = 64


@dataclass(frozen=True, slots=True)
class CoreSample:
    """Cumulative counters at one instant (seconds)."""

    at: float  # monotonic clock
    waited_s: float  # this process's threads: runnable, not running (summed)


@dataclass(frozen=True, slots=True)
class ThreadPolicy:
    """The decision over one window, with no I/O (see the module docstring)."""

    threads: int  # the engine's intra-op threads
    wait_share: float = 0.1

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if not 0 < self.wait_share < 1:
            raise ValueError("wait_share must be in (0, 1)")

    def shared(self, start: CoreSample, end: CoreSample, stepping_s: float) -> bool:
        """Whether the threads, stepping ``stepping_s`` of the window, waited for a CPU
        beyond ``wait_share`` of that time."""
        return end.waited_s - start.waited_s > self.wait_share * stepping_s * self.threads


class ThreadGovernor:
    """Applies :class:`ThreadPolicy` to the engine's steps: call :meth:`step_started`
    before each forward and :meth:`step_ended` after it. ``throttle(True)`` makes the
    threads' waits short, ``throttle(False)`` long again.

    An idle spell longer than ``stale_gap_s`` starts a new window: what was measured
    before it is stale.
    """

    def __init__(
        self,
        policy: ThreadPolicy,
        read: Callable[[float], CoreSample | None],
        throttle: Callable[[bool], None],
        clock: Callable[[], float] = time.monotonic,
        window_s: float = 0.5,
        stale_gap_s: float = 1.0,
    ) -> None:
        self.policy = policy
        self.throttled = False
        self.changes = 0  # throttle changes so far (for the worker's metrics)
        self._read, self._throttle, self._clock = read, throttle, clock
        self._window_s, self._stale_gap_s = window_s, stale_gap_s
        self._start: CoreSample | None = None
        self._stepping_s = 0.0  # in the window: inside forwards
        self._began: float | None = None  # the forward under way
        self._last_end: float | None = None
        self._free_needed = 1  # windows in a row without waiting
        self._free_seen = 0
        self._released = False  # long waits back on for under one window

    def step_started(self) -> None:
        now = self._clock()
        if self._last_end is not None and now - self._last_end > self._stale_gap_s:
            self._start = None
            self._free_seen = 0
        if self._start is None or self._stepping_s >= self._window_s:
            end = self._read(now)
            if self._start is not None and end is not None:
                self._decide(self.policy.shared(self._start, end, self._stepping_s))
            self._start, self._stepping_s = end, 0.0
        self._began = now

    def step_ended(self) -> None:
        now = self._clock()
        if self._began is not None:
            self._stepping_s += now - self._began
            self._began = None
        self._last_end = now

    def _decide(self, shared: bool) -> None:
        if not self.throttled:
            released, self._released = self._released, False
            if not shared:
                if released:  # the other job is gone
                    self._free_needed = 1
                return
            if released:  # released too soon: wait longer next time
                self._free_needed = min(2 * self._free_needed, MAX_FREE_WINDOWS)
            self._set(True)
            return
        if shared:
            self._free_seen = 0
            return
        self._free_seen += 1
        if self._free_seen >= self._free_needed:
            self._free_seen = 0
            self._released = True
            self._set(False)

    def _set(self, throttled: bool) -> None:
        self.throttled = throttled
        self.changes += 1
        self._throttle(throttled)


class SpinThrottle:
    """Short OpenMP waits on demand: an idle pool of ``pool`` OpenMP threads held by a
    thread of its own (libgomp keeps a pool per thread that started parallel work), which
    makes libgomp manage more threads than CPUs. ``set`` returns once libgomp has it."""

    def __init__(self, libgomp: ctypes.CDLL, pool: int) -> None:
        self._libgomp = libgomp
        self._pool = pool
        # the pool's threads run this and return: any exported function of no
        # arguments will do (the argument GOMP_parallel passes is ignored), no Python
        self._noop = ctypes.cast(libgomp.omp_get_thread_num, ctypes.c_void_p)
        self._requests: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._holder: threading.Thread | None = None  # started at the first call

    def set(self, throttled: bool) -> None:
        if self._holder is None:  # most engines never share their cores: no thread idle
            self._holder = threading.Thread(
                target=self._hold, name="kvserve-spin-throttle", daemon=True
            )
            self._holder.start()
        self._requests.put(throttled)
        self._done.get()

    def _hold(self) -> None:
        while True:
            if self._requests.get():
                self._libgomp.GOMP_parallel(self._noop, None, self._pool, 0)
            else:
                self._libgomp.omp_pause_resource_all(OMP_PAUSE_SOFT)
            self._done.put(None)


def read_core_sample(now: float) -> CoreSample | None:
    """This process's threads' CPU wait from ``/proc``; None where Linux does not count
    it (then nothing is governed)."""
    waited_ns = 0
    try:
        for task in list(Path("/proc/self/task").iterdir()):
            try:
                waited_ns += int((task / "schedstat").read_text().split()[1])
            except FileNotFoundError:  # the thread ended since the listing
                continue
    except (OSError, ValueError, IndexError):
        return None
    return CoreSample(now, waited_ns / 1e9)


def governor_for(device: torch.device) -> ThreadGovernor | None:
    """A governor for a CPU engine given several threads (as :func:`~kvserve.engine.
    device.use_threads` or torch's default set them) that spin as ``kvserve.engine`` set
    them to, where Linux counts the wait and torch runs on libgomp; otherwise None. A
    wait the user chose is theirs to keep."""
    threads = torch.get_num_threads()
    user_wait = "OMP_WAIT_POLICY" in os.environ or (
        os.environ.get("GOMP_SPINCOUNT", GOVERNED_SPINCOUNT) != GOVERNED_SPINCOUNT
    )
    if device.type != "cpu" or threads < 2 or user_wait or read_core_sample(0.0) is None:
        return None
    libgomp = loaded_libgomp()
    if libgomp is None:
        return None
    cpus = len(os.sched_getaffinity(0))
    throttle = SpinThrottle(libgomp, pool=cpus + 1)
    return ThreadGovernor(ThreadPolicy(threads), read_core_sample, throttle.set)
