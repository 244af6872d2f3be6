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
    """Scripted counters: each window, how much the process waited and the CPUs idled."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waited = 0.0
        self.idle = 0.0
        self.reads = 0

    def read(self, now: float) -> CoreSample:
        self.reads += 1
        return CoreSample(now, self.waited, self.idle)

    def clock(self) -> float:
        return self.now


def _governor(cores: Cores, threads: int = 2) -> tuple[ThreadGovernor, list[int]]:
    applied: list[int] = []
    governor = ThreadGovernor(
        ThreadPolicy(threads), cores.read, applied.append, cores.clock, window_s=0.45
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
    others_idle: float = 0.0,
) -> None:
    """``steps`` forwards of ``step_s``, ``gap_s`` apart. While stepping the process's
    threads wait ``waiting`` s a second; the other CPU idles ``others_idle`` of each
    second, the engine's own CPU in the gaps. A window is 5 steps of 0.1 s."""
    for _ in range(steps):
        governor.step_started()
        cores.now += step_s
        cores.waited += waiting * step_s
        cores.idle += others_idle * step_s
        governor.step_ended()
        cores.now += gap_s
        cores.idle += (others_idle + 1) * gap_s


def test_all_threads_stay_on_while_the_process_hardly_waits() -> None:
    cores = Cores()
    governor, applied = _governor(cores)
    _run(governor, cores, 50, waiting=0.18)  # 9 % of two threads' time
    assert governor.running == 2 and applied == []


def test_waiting_for_a_cpu_drops_to_one_thread_until_the_others_are_free() -> None:
    cores = Cores()
    governor, applied = _governor(cores)
    _run(governor, cores, 6, waiting=1.0)  # half the two threads' time waiting
    assert governor.running == 1 and applied == [1]
    _run(governor, cores, 30, waiting=0.3, others_idle=0.05)  # the other CPU busy
    assert applied == [1]
    _run(governor, cores, 11, others_idle=0.9)
    assert governor.running == 2 and applied == [1, 2]


def test_a_restore_that_proves_wrong_doubles_the_free_windows_needed() -> None:
    cores = Cores()
    governor, applied = _governor(cores)
    needed = []
    for _ in range(8):
        while governor.running == 2:
            _run(governor, cores, 1, waiting=1.0)
        steps = 0
        while governor.running == 1:
            _run(governor, cores, 1, others_idle=1.0)
            steps += 1
        needed.append(steps // 5)
    assert needed == [1, 2, 4, 8, 16, 32, 64, 64] and MAX_FREE_WINDOWS == 64
    # free for a whole window after a restore: the next drop needs one window again
    _run(governor, cores, 5, others_idle=1.0)
    while governor.running == 2:
        _run(governor, cores, 1, waiting=1.0)
    _run(governor, cores, 5, others_idle=1.0)
    assert governor.running == 2 and applied[-3:] == [2, 1, 2]


def test_an_idle_spell_starts_a_new_window() -> None:
    """Between requests the engine's own CPU idles: that is not room for its threads,
    and what was measured before a long idle spell says nothing of the cores now."""
    cores = Cores()
    governor, applied = _governor(cores)
    _run(governor, cores, 6, waiting=1.0)
    assert governor.running == 1
    _run(governor, cores, 1, others_idle=1.0, gap_s=5.0)  # both CPUs idle for 5 s
    _run(governor, cores, 20, waiting=0.3)
    assert governor.running == 1 and applied == [1]


def test_sparse_steps_fill_a_window_with_their_stepping_time() -> None:
    """A worker serving now and then: 10 ms steps 30 ms apart."""
    cores = Cores()
    governor, applied = _governor(cores)
    sparse = {"step_s": 0.01, "gap_s": 0.03}
    _run(governor, cores, 50, waiting=1.0, **sparse)  # half the stepping time waiting
    assert governor.running == 1 and applied == [1]
    _run(governor, cores, 200, waiting=0.5, **sparse)  # own CPU idle in the gaps only
    assert governor.running == 1
    _run(governor, cores, 100, others_idle=0.9, **sparse)
    assert governor.running == 2 and applied == [1, 2]


def test_no_counters_no_decision() -> None:
    applied: list[int] = []
    clock = iter(range(100))
    governor = ThreadGovernor(
        ThreadPolicy(2), lambda now: None, applied.append, lambda: next(clock) * 0.3
    )
    for _ in range(20):
        governor.step_started()
        governor.step_ended()
    assert governor.running == 2 and applied == []


def test_policy_rejects_what_cannot_decide() -> None:
    with pytest.raises(ValueError):
        ThreadPolicy(0)
    with pytest.raises(ValueError):
        ThreadPolicy(2, wait_share=1.5)
    with pytest.raises(ValueError):
        ThreadPolicy(2, free_share=0)


def test_linux_counts_this_process_and_its_cpus() -> None:
    first = read_core_sample(1.0)
    busy_until = time.monotonic() + 0.05
    while time.monotonic() < busy_until:
        pass
    second = read_core_sample(2.0)
    assert first is not None and second is not None
    assert 0 <= first.waited_s <= second.waited_s
    assert 0 <= first.idle_s <= second.idle_s
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


def test_beside_busy_jobs_the_runner_drops_to_one_thread_and_torch_runs_one(
    tiny_model_dir: Path, two_threads: None
) -> None:
    runner = ModelRunner(tiny_model_dir, num_blocks=64, block_size=16, device="cpu")
    governor = runner.threads
    assert governor is not None and governor.running == 2
    item = SequenceBatchItem(list(range(1, 200)), 0, list(range(13)))
    hogs = _hogs(2 * len(os.sched_getaffinity(0)))
    try:
        deadline = time.monotonic() + 60
        while governor.running == 2 and time.monotonic() < deadline:
            runner.forward([item])
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert governor.running == 1 and governor.changes == 1
    assert torch.get_num_threads() == 1
