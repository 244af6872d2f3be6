"""Moving KV blocks to and from the storage tier off the engine thread.

The engine thread owns the device pool and must never wait on a disk or a network: it
copies blocks to CPU tensors itself (a memory copy, between steps) and hands them to
:class:`StorageWriter`, whose bounded queue drops a write rather than block when the
store falls behind (the block is simply not shared; nothing is wrong). Lookups and
reads go the other way through :class:`StorageLoader`: it asks the store for the
longest stored prefix, reads and verifies the values (checksum, key, layout) and
returns CPU tensors that the engine thread installs between steps into freshly
allocated device blocks that nothing else can see until they are committed.

Every backend failure is counted by kind in a :class:`FaultLog` and logged once, and
turns into a miss: the worker recomputes, never crashes, never installs unchecked bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from kvserve.engine.kv_block_io import KVBlockLayout
from kvserve.engine.storage.base import KVStorage, StorageError
from kvserve.engine.storage.block_codec import CorruptBlock, decode, encode

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0

Job = TypeVar("Job")


class FaultLog:
    """Faults counted by kind; the first of each kind is logged (a dead server would
    otherwise log once per request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def record(self, kind: str, error: Exception) -> None:
        with self._lock:
            seen = self.counts.get(kind, 0)
            self.counts[kind] = seen + 1
        if not seen:
            logger.warning(
                "KV storage %s fault: %s; recomputing instead (further %s faults are only "
                "counted, in kvserve_kv_tier_faults)",
                kind,
                error,
                kind,
            )

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class _JobThread(Generic[Job]):
    """A daemon thread running ``handle`` on each submitted job, in order."""

    def __init__(self, name: str, handle: Callable[[Job], None]) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._handle = handle
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _submit(self, job: Job) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._handle(job)

    def close(self) -> None:
        """Finish the jobs already submitted (for a few seconds at most), then stop."""
        self._jobs.put(None)
        self._thread.join(_JOIN_TIMEOUT_S)


@dataclass(frozen=True, slots=True)
class WriteJob:
    hashes: tuple[int, ...]  # a chain, root first
    parent_hash: int | None  # the block before the first one
    blocks: torch.Tensor  # [len(hashes), *block_shape] on the CPU, owned by the job


@dataclass(frozen=True, slots=True)
class WriteDone:
    hashes: tuple[int, ...]
    parent_hash: int | None
    ok: bool  # False: the backend failed (counted as a fault)
    evicted: list[int] = field(default_factory=list)  # keys dropped to make room


class StorageWriter(_JobThread[WriteJob]):
    """Writes blocks in the background; at most ``max_pending_blocks`` wait at a time."""

    def __init__(
        self, storage: KVStorage, layout: KVBlockLayout, faults: FaultLog, max_pending_blocks: int
    ) -> None:
        self._storage = storage
        self._layout = layout
        self._faults = faults
        self._max_pending = max_pending_blocks
        self._lock = threading.Lock()
        self._pending = 0
        self.written_blocks = 0
        self.dropped_blocks = 0
        self.failed_blocks = 0
        self.done: queue.SimpleQueue[WriteDone] = queue.SimpleQueue()
        super().__init__("kvserve-kv-writer", self._write)

    def submit(self, job: WriteJob) -> bool:
        """Queue ``job``; False (dropped, counted) if the queue is full."""
        size = len(job.hashes)
        with self._lock:
            if self._pending + size > self._max_pending:
                self.dropped_blocks += size
                return False
            self._pending += size
        self._submit(job)
        return True

    def _write(self, job: WriteJob) -> None:
        size = len(job.hashes)
        try:
            items = [
                (key, encode(self._layout, key, job.blocks[i : i + 1]))
                for i, key in enumerate(job.hashes)
            ]
            evicted = self._storage.put_many(items)
        except StorageError as error:
            self._faults.record("write", error)
            self.failed_blocks += size
            self.done.put(WriteDone(job.hashes, job.parent_hash, ok=False))
        else:
            self.written_blocks += size
            self.done.put(WriteDone(job.hashes, job.parent_hash, ok=True, evicted=evicted))
        finally:
            with self._lock:
                self._pending -= size


@dataclass(frozen=True, slots=True)
class LoadJob:
    request_id: str
    start: int  # block index of ``hashes[0]`` in the request's chain
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadResult:
    request_id: str
    start: int
    blocks: torch.Tensor  # the verified blocks of ``hashes[:len(blocks)]`` (maybe none)
    hashes: tuple[int, ...] = field(repr=False)


class StorageLoader(_JobThread[LoadJob]):
    """Finds and reads the longest stored prefix of each job's chain in the background."""

    def __init__(self, storage: KVStorage, layout: KVBlockLayout, faults: FaultLog) -> None:
        self._storage = storage
        self._layout = layout
        self._faults = faults
        self._results: queue.Queue[LoadResult] = queue.Queue()
        super().__init__("kvserve-kv-loader", self._load)

    def submit(self, job: LoadJob) -> None:
        self._submit(job)

    def results(self, timeout_s: float = 0.0) -> list[LoadResult]:
        """The results ready now, waiting up to ``timeout_s`` for a first one."""
        found: list[LoadResult] = []
        try:
            found.append(
                self._results.get(timeout=timeout_s) if timeout_s else self._results.get_nowait()
            )
            while True:
                found.append(self._results.get_nowait())
        except queue.Empty:
            return found

    def _load(self, job: LoadJob) -> None:
        blocks: list[torch.Tensor] = []
        try:
            stored = self._storage.exists(job.hashes)
            values = self._storage.get_many(job.hashes[:stored]) if stored else []
            for key, value in zip(job.hashes, values, strict=False):
                if value is None:
                    break  # evicted between the lookup and the read
                blocks.append(decode(self._layout, key, value))
        except StorageError as error:
            self._faults.record("read", error)
        except CorruptBlock as error:
            self._faults.record("corrupt", error)
            self._drop_corrupt(job.hashes[len(blocks)])
        stacked = (
            torch.cat(blocks)
            if blocks
            else torch.empty((0, *self._layout.block_shape), dtype=self._layout.torch_dtype)
        )
        self._results.put(LoadResult(job.request_id, job.start, stacked, job.hashes))

    def _drop_corrupt(self, key: int) -> None:
        """A corrupt value would fail every later load and block its rewrite: remove it."""
        try:
            self._storage.delete_many([key])
        except StorageError as error:
            self._faults.record("read", error)
