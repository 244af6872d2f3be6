"""Load accounting shared by a router's processes (``--processes N``).

Each process holds its own guards (:class:`~kvserve.router.load_guard.LoadTracker`) and
publishes what they hold in one row of a table in shared memory: per worker slot, its
in-flight requests and prefill tokens. Only the owning process writes a row; a load read
sums the worker's column over every row. So each process's policy and guards see the
fleet's whole in-flight load at that instant, exactly, with no messages and no lock:
each cell is an aligned 8-byte integer, written and read whole.

The table is an anonymous shared mapping made by the parent before it forks the
processes, which inherit it; it has one slot per worker of the fleet the router starts
with, and spare slots for workers added at run time (``fleet_changes.py``: every process
adds them in the same order, so slots agree). It also holds each
process's count of client connections, so that ``--max-connections`` bounds the router's
connections, not each process's (:class:`ConnectionTally`).
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping

from kvserve.core.routing.types import WorkerLoad
from kvserve.router.load_guard import LoadListener, LoadTracker

_CELL = 8  # bytes of one int64


class SharedLoadTable:
    """``processes`` rows x ``slots`` workers x (requests, prefill tokens), int64."""

    def __init__(self, processes: int, slots: int) -> None:
        self.processes = processes
        self.slots = slots
        # MAP_SHARED | MAP_ANONYMOUS: shared with the children forked after this. The
        # loads' cells come first, then one cell per process for its client connections.
        self._connections_at = processes * slots * 2
        self._memory = mmap.mmap(-1, (self._connections_at + processes) * _CELL)
        self._cells = memoryview(self._memory).cast("q")

    def write_connections(self, process: int, count: int) -> None:
        self._cells[self._connections_at + process] = count

    def connections_except(self, process: int) -> int:
        """The client connections every other process holds."""
        at = self._connections_at
        return sum(self._cells[at + p] for p in range(self.processes) if p != process)

    def write(self, process: int, slot: int, requests: int, prefill_tokens: int) -> None:
        at = (process * self.slots + slot) * 2
        self._cells[at] = requests
        self._cells[at + 1] = prefill_tokens

    def row_values(self, slot: int) -> list[tuple[int, int]]:
        """Each process's (requests, prefill tokens) on ``slot``, by process index."""
        cells, stride = self._cells, self.slots * 2
        return [
            (cells[p * stride + slot * 2], cells[p * stride + slot * 2 + 1])
            for p in range(self.processes)
        ]

    def total(self, slot: int) -> tuple[int, int]:
        cells, stride, at = self._cells, self.slots * 2, slot * 2
        requests = tokens = 0
        for _ in range(self.processes):
            requests += cells[at]
            tokens += cells[at + 1]
            at += stride
        return requests, tokens


class SharedLoadTracker(LoadTracker):
    """A :class:`LoadTracker` whose guards also publish to row ``process`` of ``table``,
    and whose loads are the sums over every process's row."""

    def __init__(
        self,
        table: SharedLoadTable,
        process: int,
        slots: Mapping[str, int],
        on_change: LoadListener | None = None,
    ) -> None:
        super().__init__()  # its listener would hear this process's share only
        self._listener = on_change
        self._table = table
        self._process = process
        self._slots = dict(slots)

    def has_room(self) -> bool:
        """Whether a worker can be added (see :meth:`add_worker`)."""
        return len(self._slots) < self._table.slots

    def add_worker(self, worker_id: str) -> None:
        """Give a worker added at run time the next slot. Every process adds the same
        workers in the same order, so slots agree; a removed worker keeps its slot (its
        in-flight requests still release into it)."""
        if not self.has_room():
            raise ValueError("the shared load table has no slot left")
        self._slots[worker_id] = len(self._slots)

    def load(self, worker_id: str) -> WorkerLoad:
        slot = self._slots.get(worker_id)
        if slot is None:
            return super().own_load(worker_id)
        requests, tokens = self._table.total(slot)
        return WorkerLoad(worker_id, requests, tokens)

    def own_load(self, worker_id: str) -> WorkerLoad:
        """The router's own guards: every process's, as one router (its processes are
        replicas on one port, summed exactly here rather than announced)."""
        return self.load(worker_id)

    def process_load(self, worker_id: str) -> tuple[int, int]:
        """(in-flight requests, prefill tokens) this process's own guards hold."""
        own = super().own_load(worker_id)
        return own.in_flight_requests, own.in_flight_prefill_tokens

    def by_process(self, worker_id: str) -> list[int]:
        """In-flight requests on ``worker_id`` held by each process, by process index."""
        slot = self._slots.get(worker_id)
        if slot is None:
            return []
        return [requests for requests, _ in self._table.row_values(slot)]

    def held_worker_ids(self) -> list[str]:
        held = dict.fromkeys(super().held_worker_ids())
        held.update((w, None) for w, s in self._slots.items() if self._table.total(s) != (0, 0))
        return list(held)

    def total_held(self) -> WorkerLoad:
        loads = [self.load(worker_id) for worker_id in self._slots]
        return WorkerLoad(
            "*",
            sum(load.in_flight_requests for load in loads),
            sum(load.in_flight_prefill_tokens for load in loads),
        )

    def _adjust(self, worker_id: str, requests: int, prefill_tokens: int) -> None:
        super()._adjust(worker_id, requests, prefill_tokens)
        slot = self._slots.get(worker_id)
        if slot is not None:
            own = super().own_load(worker_id)
            self._table.write(
                self._process, slot, own.in_flight_requests, own.in_flight_prefill_tokens
            )
        if self._listener is not None:
            self._listener(self.load(worker_id))


class ConnectionTally:
    """The router's client connections beyond this process's own: its server counts its
    own and checks ``own + others()`` against the cap, and publishes its count on every
    change. Without a table (one process) there are no others."""

    def __init__(self, table: SharedLoadTable | None = None, process: int = 0) -> None:
        self._table = table
        self._process = process

    def others(self) -> int:
        return 0 if self._table is None else self._table.connections_except(self._process)

    def publish(self, own: int) -> None:
        if self._table is not None:
            self._table.write_connections(self._process, own)
