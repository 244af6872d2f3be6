"""The CPU engine's thread governor: all threads on free cores, one on shared ones."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvserve.engine.device import loaded_libgomp
from kvserve.engine.model_runner import ModelRunner, SequenceBatchItem
from kvserve.engine.thread_governor import (
    MAX_FREE_WINDOWS,
    CoreSample,
    ThreadGovernor,
    ThreadPolicy,
    governor_for,
    read_core_sample,
)


class Cores:
    """Scripted counters: how long the process's threads waited for a CPU."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waited = 0.0

    def read(self, now: float) -> CoreSample:
        return CoreSample(now, self.waited)

    def clock(self) -> float:
        return self.now


def _governor(cores: Cores) -> tuple[ThreadGovernor, list[bool]]:
    applied: list[bool] = []
    governor = ThreadGovernor(
        ThreadPolicy(2), cores.read, applied.append, cores.clock, window_s=0.45
    )
    return governor, applied


def _run(
    governor: ThreadGovernor,
    cores: Cores,
    steps: int,
    *,
    step_s: float = 0.1,
    gap_s: float = 0.0,
    waiting: float = 0.0,
) -> None:
    """``steps`` forwards of ``step_s``, ``gap_s`` apart, the process's two threads
    waiting ``waiting`` s a second of stepping. A window is 5 steps of 0.1 s."""
    for _ in range(steps):
        governor.step_started()
        cores.now += step_s
        cores.waited += waiting * step_s
        governor.step_ended()
        cores.now += gap_s


def test_long_waits_stay_while_the_process_hardly_waits() -> None:
    cores = Cores()
    governor, applied = _governor(cores)
    _run(governor, cores, 50, waiting=0.18)  # 9 % of two threads' time
    assert not governor.throttled and applied == []


def test_waiting_for_a_cpu_makes_waits_short_until_it_stops() -> None:
    cores = Cores()
    governor, applied = _governor(cores)
    _run(governor, cores, 6, waiting=1.0)  # half the two threads' time waiting
    assert governor.throttled and applied == [True]
    _run(governor, cores, 30, waiting=0.4)
    assert applied == [True]
    _run(governor, cores, 11, waiting=0.01)
    assert not governor.throttled and applied == [True, False]


def test_a_release_that_proves_wrong_doubles_the_free_windows_needed() -> None:
    cores = Cores()
    governor, applied = _governor(cores)
    needed = []
    for _ in range(8):
        while not governor.throttled:  # (the step that starts short waits is below 10 %)
            _run(governor, cores, 1, waiting=0.5)
        steps = 0
        while governor.throttled:
            _run(governor, cores, 1)
            steps += 1
        needed.append(steps // 5)
    assert needed == [1, 2, 4, 8, 16, 32, 64, 64] and MAX_FREE_WINDOWS == 64
    # free for a whole window after a release: the next needs one window again
    _run(governor, cores, 5)
    while not governor.throttled:
        _run(governor, cores, 1, waiting=0.5)
    _run(governor, cores, 5)
    assert not governor.throttled and applied[-3:] == [False, True, False]


def test_an_idle_spell_starts_a_new_window() -> None:
    """What was measured before a long idle spell says nothing of the cores now."""
    cores = Cores()
    governor, applied = _governor(cores)
    _run(governor, cores, 4, waiting=1.0)  # 0.4 s of waiting steps: no window closed
    _run(governor, cores, 1, gap_s=5.0)
    _run(governor, cores, 8)
    assert not governor.throttled and applied == []


def test_sparse_steps_fill_a_window_with_their_stepping_time() -> None:
    """A worker serving now and then: 10 ms steps 30 ms apart."""
    cores = Cores()
    governor, applied = _governor(cores)
    _run(governor, cores, 50, waiting=1.0, step_s=0.01, gap_s=0.03)
    assert governor.throttled and applied == [True]
    _run(governor, cores, 100, step_s=0.01, gap_s=0.03)
    assert not governor.throttled and applied == [True, False]


def test_no_counters_no_decision() -> None:
    applied: list[bool] = []
    clock = iter(range(100))
    governor = ThreadGovernor(
        ThreadPolicy(2), lambda now: None, applied.append, lambda: next(clock) * 0.3
    )
    for _ in range(20):
        governor.step_started()
        governor.step_ended()
    assert not governor.throttled and applied == []


def test_policy_rejects_what_cannot_decide() -> None:
    with pytest.raises(ValueError):
        ThreadPolicy(0)
    with pytest.raises(ValueError):
        ThreadPolicy(2, wait_share=1.5)


def test_linux_counts_this_process_waiting() -> None:
    first = read_core_sample(1.0)
    busy_until = time.monotonic() + 0.05
    while time.monotonic() < busy_until:
        pass
    second = read_core_sample(2.0)
    assert first is not None and second is not None
    assert 0 <= first.waited_s <= second.waited_s
    assert second.at == 2.0


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_cuda_engine_one_thread_or_the_users_wait_is_not_governed(
    two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "100000")
    assert governor_for(torch.device("cpu")) is not None
    assert governor_for(torch.device("cuda")) is None
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert governor_for(torch.device("cpu")) is None
    monkeypatch.setenv("GOMP_SPINCOUNT", "100000")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert governor_for(torch.device("cpu")) is None
    monkeypatch.delenv("OMP_WAIT_POLICY")
    torch.set_num_threads(1)
    assert governor_for(torch.device("cpu")) is None


def _hogs(count: int) -> list[subprocess.Popen[bytes]]:
    """CPU-bound processes on this process's CPUs: other jobs wanting the engine's cores."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def test_beside_busy_jobs_the_runner_makes_its_waits_short(
    tiny_model_dir: Path, two_threads: None
) -> None:
    runner = ModelRunner(tiny_model_dir, num_blocks=64, block_size=16, device="cpu")
    governor = runner.thread_governor
    assert governor is not None and not governor.throttled
    item = SequenceBatchItem(list(range(1, 200)), 0, list(range(13)))
    hogs = _hogs(2 * len(os.sched_getaffinity(0)))
    try:
        deadline = time.monotonic() + 60
        while not governor.throttled and time.monotonic() < deadline:
            runner.forward([item])
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    try:
        assert governor.throttled and governor.changes == 1
        assert runner.intra_op_threads() == (2, True, 1)  # every thread kept
    finally:
        governor._throttle(False)  # the rest of this process's tests spin as before


# A process of its own for each probe (libgomp's pools and waits are per process): its
# OpenMP threads' sleeps (voluntary context switches) over bursts of 30 small parallel ops.
_PROBE = """
import glob, os, threading, time
import kvserve.engine  # its long OpenMP wait, before torch loads
import torch
from kvserve.engine.device import loaded_libgomp, release_openmp_threads, use_threads
from kvserve.engine.thread_governor import SpinThrottle

cpus = len(os.sched_getaffinity(0))
use_threads(max(2, cpus))
x = torch.ones(1 << 18)

def sleeps():
    by_thread = {}
    for status in glob.glob("/proc/self/task/*/status"):
        try:
            text = open(status).read()
        except OSError:  # a thread that ended since the listing: ENOENT or ESRCH
            continue
        if "voluntary_ctxt_switches:" in text:
            by_thread[status] = int(text.split("voluntary_ctxt_switches:")[1].split()[0])
    return by_thread

def gap(seconds=30e-6):
    # Python between two ops, as long on every CPU: a throttled wait (100 spins, well under
    # a microsecond on fast cores) ends inside it, a long one (100,000) does not
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass

def sleeps_in_30_ops():
    # a burst of a few ms: on a busy machine some bursts run unpreempted
    before = sleeps()
    for _ in range(30):
        x.add_(1)
        gap()
    after = sleeps()  # threads gone since are not counted, new ones from 0
    return sum(n - before.get(thread, 0) for thread, n in after.items())

def fewest(count, bursts=20):
    # the fewest sleeps of several bursts: a busy machine preempts a thread now and then
    # (its sibling then sleeps whatever the wait); the throttle makes it sleep at every op
    return min(count() for _ in range(bursts))

def on_another_thread():
    counted = []
    thread = threading.Thread(target=lambda: counted.append(sleeps_in_30_ops()))
    thread.start()
    thread.join()
    return counted[0]
"""


def _probe(script: str) -> list[str]:
    """``script`` after :data:`_PROBE`, its OpenMP threads bound one to a core: two of
    them sharing one core beside CPU hogs (a balance by count the kernel may keep for
    seconds) sleep at every op whatever the wait."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env |= {"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"}
    command = [sys.executable, "-c", _PROBE + script]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_spin_throttle_makes_openmp_threads_sleep_between_ops_and_lets_go() -> None:
    """libgomp's documented throttled wait, switched on and off at run time: the sibling
    sleeps at nearly every op boundary while the pool is held, hardly ever without it."""
    assert loaded_libgomp() is not None  # torch runs on libgomp here
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("needs two CPUs: on one, two threads are throttled already")
    out = _probe(
        "throttle = SpinThrottle(loaded_libgomp(), cpus + 1)\n"
        "sleeps_in_30_ops()  # the pool made before counting\n"
        "counts = []\n"
        "for throttled in (True, False):\n"
        "    throttle.set(throttled)\n"
        "    counts.append(fewest(sleeps_in_30_ops, 20 if throttled else 200))\n"
        "print(*counts)\n"
    )
    throttled, released = map(int, out)
    assert throttled >= 30 and released * 4 < throttled, out


def test_releasing_the_loading_threads_pool_lets_the_stepping_thread_spin() -> None:
    """The same throttle, unasked: each thread that started parallel work keeps a pool, so
    the thread that loaded a worker's model must let go of its own for the engine's thread
    to spin between ops."""
    out = _probe(
        "x.add_(1)  # the main thread's own pool, as a worker's model loading makes one\n"
        "throttled = fewest(on_another_thread)\n"
        "print(release_openmp_threads(), throttled, fewest(on_another_thread, 200))\n"
    )
    released, throttled, after = out[0] == "True", int(out[1]), int(out[2])
    assert released
    assert throttled >= 30 and after * 4 < throttled, out
