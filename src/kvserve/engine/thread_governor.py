"""How many of its cores a CPU engine uses: all of them while no other job wants them,
one while they are shared.

A step is a hundred-odd parallel ops back to back. Between two of them torch's OpenMP
threads (libgomp) spin for ``GOMP_SPINCOUNT`` iterations, then sleep; waking a sleeping
sibling costs more than the op's split saves (on the 2-core dev VM, about 140 µs a wake,
~3,500 wakes a round of the shared-prefix benchmark with 1,000 spins, which made two
threads 20-30 % slower than with libgomp's own 300,000). Spinning is right on cores the
engine has to itself and ruinous on cores shared with other busy jobs: a spinning sibling
uses up its share of the core, so the thread that has the op's work waits a scheduler
slice for it (two threads beside two CPU hogs: 25 tok/s spinning, 40-48 on one thread).

So the engine spins (``kvserve.engine`` sets the count, see there) and this governor
watches whether that is still right, from what Linux counts anyway:

- with all threads on: the time this process's threads spent runnable but waiting for a
  CPU (``run_delay`` in ``/proc/<pid>/task/<tid>/schedstat``). Beyond
  ``wait_share`` of the threads' time in a window, the cores are shared: one thread;
- with one thread: the idle time of the other CPUs this process may use (``/proc/stat``).
  At least ``free_share`` of each idle over ``free_windows`` windows in a row, they are
  free again: all threads. Each time that proves wrong (shared again within one window)
  the windows needed double, up to ``MAX_FREE_WINDOWS``, so that a job that comes and
  goes does not make the engine spin against it every other window.

A window is ``window_s`` of stepping, however sparse the steps: waiting is counted against
the time spent in forwards, idleness less the engine's own gaps between them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.engine import GOVERNED_SPINCOUNT

MAX_FREE_WINDOWS = 64


@dataclass(frozen=True, slots=True)
class CoreSample:
    """Cumulative counters at one instant (seconds)."""

    at: float  # monotonic clock
    waited_s: float  # this process's threads: runnable, not running (summed)
    idle_s: float  # the CPUs this process may run on: idle (summed)


@dataclass(frozen=True, slots=True)
class ThreadPolicy:
    """The decision over one window, with no I/O (see the module docstring)."""

    threads: int  # all the threads the engine was given
    wait_share: float = 0.1
    free_share: float = 0.6

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if not 0 < self.wait_share < 1 or not 0 < self.free_share <= 1:
            raise ValueError("wait_share must be in (0, 1) and free_share in (0, 1]")

    def shared(self, start: CoreSample, end: CoreSample, running: int, stepping_s: float) -> bool:
        """Whether ``running`` threads, stepping ``stepping_s`` of the window, waited for
        a CPU beyond ``wait_share`` of that time (between steps they sleep, and wait for
        nothing)."""
        return end.waited_s - start.waited_s > self.wait_share * stepping_s * running

    def free(self, start: CoreSample, end: CoreSample, gaps_s: float) -> bool:
        """Whether the CPUs beside the one thread's idled enough for the others. The
        thread's own CPU idles in the window's ``gaps_s`` between steps: not counted."""
        others_idle = end.idle_s - start.idle_s - gaps_s
        return others_idle >= self.free_share * (end.at - start.at) * (self.threads - 1)


class ThreadGovernor:
    """Applies :class:`ThreadPolicy` to the engine's steps: call :meth:`step_started`
    before each forward and :meth:`step_ended` after it, on the thread that runs it
    (torch's thread count is that thread's OpenMP setting).

    A window closes once the engine has stepped ``window_s`` in it, however sparse its
    steps (a worker serving a request now and then); an idle spell longer than
    ``stale_gap_s`` starts a new one, since what was measured before it is stale.
    """

    def __init__(
        self,
        policy: ThreadPolicy,
        read: Callable[[float], CoreSample | None],
        apply: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        window_s: float = 0.5,
        stale_gap_s: float = 1.0,
    ) -> None:
        self.policy = policy
        self.running = policy.threads
        self.changes = 0  # thread count changes so far (for logs and tests)
        self._read, self._apply, self._clock = read, apply, clock
        self._window_s, self._stale_gap_s = window_s, stale_gap_s
        self._start: CoreSample | None = None
        self._stepping_s = 0.0  # in the window: inside forwards
        self._gaps_s = 0.0  # in the window: between them
        self._began: float | None = None  # the forward under way
        self._last_end: float | None = None
        self._free_needed = 1  # windows in a row with the other CPUs free
        self._free_seen = 0
        self._restored = False  # all threads back on for under one window

    def step_started(self) -> None:
        now = self._clock()
        if self._start is not None and self._last_end is not None:
            gap = now - self._last_end
            if gap > self._stale_gap_s:
                self._start = None
                self._free_seen = 0
            else:
                self._gaps_s += gap
        if self._start is None or self._stepping_s >= self._window_s:
            end = self._read(now)
            if self._start is not None and end is not None:
                self._decide(self._start, end)
            self._start, self._stepping_s, self._gaps_s = end, 0.0, 0.0
        self._began = now

    def step_ended(self) -> None:
        now = self._clock()
        if self._began is not None:
            self._stepping_s += now - self._began
            self._began = None
        self._last_end = now

    def _decide(self, start: CoreSample, end: CoreSample) -> None:
        policy = self.policy
        if self.running > 1:
            restored, self._restored = self._restored, False
            if not policy.shared(start, end, self.running, self._stepping_s):
                if restored:  # the other job is gone
                    self._free_needed = 1
                return
            if restored:  # freed too soon: wait longer next time
                self._free_needed = min(2 * self._free_needed, MAX_FREE_WINDOWS)
            self._set(1)
            return
        if not policy.free(start, end, self._gaps_s):
            self._free_seen = 0
            return
        self._free_seen += 1
        if self._free_seen >= self._free_needed:
            self._free_seen = 0
            self._restored = True
            self._set(policy.threads)

    def _set(self, threads: int) -> None:
        self.running = threads
        self.changes += 1
        self._apply(threads)


def read_core_sample(now: float) -> CoreSample | None:
    """This process's CPU wait and its CPUs' idle time from ``/proc``; None where Linux
    does not count them (then the engine keeps all its threads)."""
    waited_ns = 0
    try:
        tasks = list(Path("/proc/self/task").iterdir())
        for task in tasks:
            try:
                waited_ns += int((task / "schedstat").read_text().split()[1])
            except FileNotFoundError:  # the thread ended since the listing
                continue
        cpus = os.sched_getaffinity(0)
        idle_ticks = 0
        for line in Path("/proc/stat").read_text().splitlines():
            name, _, rest = line.partition(" ")
            if name.startswith("cpu") and name != "cpu" and int(name[3:]) in cpus:
                fields = rest.split()
                idle_ticks += int(fields[3]) + int(fields[4])  # idle + iowait
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return CoreSample(now, waited_ns / 1e9, idle_ticks / os.sysconf("SC_CLK_TCK"))


def governor_for(device: torch.device) -> ThreadGovernor | None:
    """A governor for a CPU engine given several threads (as :func:`~kvserve.engine.
    device.use_threads` or torch's default set them) that spin as ``kvserve.engine`` set
    them to, where Linux counts what it reads; otherwise None. A wait the user chose is
    theirs to keep, and with a short one each sibling's wake-up (100 µs and more in a VM)
    counts as waiting for a CPU: on the dev VM, 1,000 spins read as shared cores."""
    threads = torch.get_num_threads()
    user_wait = "OMP_WAIT_POLICY" in os.environ or (
        os.environ.get("GOMP_SPINCOUNT", GOVERNED_SPINCOUNT) != GOVERNED_SPINCOUNT
    )
    if device.type != "cpu" or threads < 2 or user_wait or read_core_sample(0.0) is None:
        return None
    return ThreadGovernor(ThreadPolicy(threads), read_core_sample, torch.set_num_threads)
