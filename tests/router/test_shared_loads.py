"""The shared load table: each process writes its own row, every load read sums them."""

from __future__ import annotations

import os

import pytest

from kvserve.core.routing.types import WorkerLoad
from kvserve.router.shared_loads import ConnectionTally, SharedLoadTable, SharedLoadTracker

SLOTS = {"w0": 0, "w1": 1}


def test_two_processes_rows_sum_exactly_and_return_to_zero() -> None:
    table = SharedLoadTable(2, len(SLOTS))
    heard: list[WorkerLoad] = []
    first = SharedLoadTracker(table, 0, SLOTS, on_change=heard.append)
    second = SharedLoadTracker(table, 1, SLOTS)
    a = first.acquire("w0", 100)
    b = second.acquire("w0", 30)
    c = second.acquire("w1", 7)
    assert first.load("w0") == second.load("w0") == WorkerLoad("w0", 2, 130)
    assert first.load("w1") == WorkerLoad("w1", 1, 7)
    assert first.by_process("w0") == [1, 1]
    assert heard[-1] == WorkerLoad("w0", 1, 100)  # the listener hears totals, not shares
    assert set(first.held_worker_ids()) == {"w0", "w1"}
    b.release_prefill()
    assert first.load("w0") == WorkerLoad("w0", 2, 100)
    assert first.total_held() == WorkerLoad("*", 3, 107)
    for guard in (a, b, c, b):  # a second release counts nothing
        guard.release()
    assert first.total_held() == second.total_held() == WorkerLoad("*", 0, 0)
    assert first.held_worker_ids() == []


def test_a_forked_child_row_is_seen_by_the_parent() -> None:
    table = SharedLoadTable(2, len(SLOTS))
    parent = SharedLoadTracker(table, 0, SLOTS)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child holds two requests on w1, says so, and exits holding them
        child = SharedLoadTracker(table, 1, SLOTS)
        child.acquire("w1", 5)
        child.acquire("w1", 6)
        os.write(write, b"x")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"x"
    os.waitpid(pid, 0)
    assert parent.load("w1") == WorkerLoad("w1", 2, 11)
    assert parent.by_process("w1") == [0, 2]


def test_a_worker_without_a_slot_is_counted_by_this_process_only() -> None:
    tracker = SharedLoadTracker(SharedLoadTable(2, 1), 0, {"w0": 0})
    guard = tracker.acquire("w9", 3)
    assert tracker.load("w9") == WorkerLoad("w9", 1, 3)
    assert tracker.by_process("w9") == []
    guard.release()
    with pytest.raises(AssertionError):
        guard._tracker._adjust("w9", -1, 0)


def test_each_process_sees_the_others_connections_and_not_its_own() -> None:
    table = SharedLoadTable(3, len(SLOTS))
    tallies = [ConnectionTally(table, p) for p in range(3)]
    tallies[0].publish(5)
    tallies[2].publish(2)
    assert [t.others() for t in tallies] == [2, 7, 5]
    tallies[0].publish(0)
    assert tallies[1].others() == 2
    first = SharedLoadTracker(table, 0, SLOTS)  # the connections' cells are apart
    first.acquire("w1", 9)
    assert tallies[1].others() == 2 and first.load("w1") == WorkerLoad("w1", 1, 9)
    assert ConnectionTally().others() == 0  # one process: nobody else
