"""Same-host PD transfer: runs written straight into the decode worker's shared memory.

Over loopback TCP each KV byte is copied twice by the kernel (into the socket buffer and
out of it) in small segments, which bounds it near a fifth of a memcpy
(docs/benchmarks.md). When both workers share a host, the decode worker instead creates
a segment under ``/dev/shm`` for one transfer and names it in its request; the prefill
worker maps it and copies each run into its slot (one copy, into shared pages), then
sends the run's frame without a payload on the same TCP connection. The conversation,
and with it the lease, fences and cancellation, is unchanged.

Whether the peer can map the segment is checked, not assumed: the prefill side tries to
open it (only a regular file of this module's name pattern and the announced size) and,
if it cannot, sends payload frames as before; the decode side accepts either kind of
frame. The decode side unlinks the segment when the transfer ends, however it ends
(done, error, cancellation, worker shutdown): the name is gone at once, the pages when
the last mapping of them goes.
"""

from __future__ import annotations

import bisect
import mmap
import os
import re
import secrets
import socket
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvserve.engine.kv_block_io import KVBlockLayout

if TYPE_CHECKING:
    from kvserve.worker.tcp_kv_transfer import PayloadLanding

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "kvserve-pd-"
_SEGMENT_NAME = re.compile(r"kvserve-pd-\d+-[0-9a-f]{16}")
_MIN_SEGMENT_BYTES = 1 << 20


def host_id() -> str:
    """This kernel's boot id: two workers that report the same one share a host (and,
    outside containers with private ``/dev/shm``, its shared memory)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _mapped(fd: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of the file ``fd`` as a ``uint8`` tensor; the mapping lives as long as
    the tensor (and its views) do. Its page tables are filled at once (``MAP_POPULATE``):
    a fault per 4 KiB on first touch made the copy several times slower
    (docs/benchmarks.md)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapping = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


class Segment:
    """A named shared-memory file this process made, reused from transfer to transfer
    while it is kept (:class:`SegmentPool`), unlinked when it is closed. Its pages are
    allocated when it is made (``posix_fallocate``), so a full ``/dev/shm`` fails that
    (``OSError``: the transfer then uses payload frames), not the peer's write
    (``SIGBUS``). Names carry the maker's pid, so that segments a killed worker left are
    found (:func:`remove_orphans`)."""

    def __init__(self, nbytes: int) -> None:
        self.name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = SHM_DIR / self.name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            self.memory = _mapped(fd, nbytes)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)  # the mapping keeps the pages

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes

    def close(self) -> None:
        """The name is gone; the pages go with the last mapping of them (the prefill
        side's included)."""
        (SHM_DIR / self.name).unlink(missing_ok=True)


def remove_orphans() -> None:
    """Unlink the segments of workers that are gone (killed before they could)."""
    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}*"):
        if not _SEGMENT_NAME.fullmatch(path.name):
            continue
        pid = int(path.name.split("-")[2])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, another user's


def _capacity(nbytes: int) -> int:
    """A power of two, so that a kept segment fits later transfers of other sizes."""
    return max(_MIN_SEGMENT_BYTES, 1 << (nbytes - 1).bit_length())


class SegmentPool:
    """Decode side: segments to offer; up to ``keep_bytes`` of those given back after a
    transfer that finished are kept (named, so a worker has up to that much in
    ``/dev/shm`` between transfers), since a new one costs its pages' allocation and the
    peer's mapping of them, several times the copy into it (docs/benchmarks.md)."""

    def __init__(self, keep_bytes: int) -> None:
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()  # taken on worker threads, given back on the loop
        self._free: list[tuple[int, int, Segment]] = []  # (capacity, id, segment)
        self._free_bytes = 0

    def take(self, nbytes: int) -> Segment:
        """A segment of at least ``nbytes``: the smallest kept one, else a new one.
        Blocking: a new one's pages are allocated."""
        with self._lock:
            found = bisect.bisect_left(self._free, (nbytes,))
            if found < len(self._free):
                capacity, _, segment = self._free.pop(found)
                self._free_bytes -= capacity
                return segment
        return Segment(_capacity(nbytes))

    def stock(self, nbytes: int) -> None:
        """Make and keep a segment for transfers of up to ``nbytes`` (at most what is
        kept), so that the first transfer does not wait for its pages. Blocking."""
        self.give_back(Segment(min(_capacity(nbytes), self._keep_bytes)))

    def give_back(self, segment: Segment) -> None:
        """``segment``'s transfer finished (no write into it is in flight): keep it, or
        close it if enough is kept already."""
        with self._lock:
            if self._free_bytes + segment.nbytes <= self._keep_bytes:
                bisect.insort(self._free, (segment.nbytes, id(segment), segment))
                self._free_bytes += segment.nbytes
                return
        segment.close()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes

    def close(self) -> None:
        """Close every kept segment (the worker stops)."""
        with self._lock:
            free, self._free, self._free_bytes = self._free, [], 0
        for _, _, segment in free:
            segment.close()


class SegmentMaps:
    """Prefill side: decode workers' segments mapped here, kept (up to ``keep_bytes``,
    least recently used first out) so that a reused segment is not mapped again; mapping
    one costs its page tables, about twice the copy into it. A kept mapping holds the
    file, so its inode number names it; those whose name is gone (their decode worker
    closed them, or stopped) are dropped by :meth:`drop_unlinked`, called after each
    transfer's last frame, so that they do not hold the pages of segments nobody can
    offer again, and freeing those pages delays no transfer."""

    def __init__(self, own_host_id: str, keep_bytes: int) -> None:
        self._host_id = own_host_id
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()  # sending threads of concurrent transfers
        self._maps: OrderedDict[tuple[int, int], tuple[str, torch.Tensor]] = OrderedDict()
        self._bytes = 0

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def open(self, offer: Any, needed: int) -> torch.Tensor | None:
        """The first ``needed`` bytes of the decode worker's segment ``offer`` mapped
        here, or None if it is not one this host can serve (another host, a bad name, a
        missing file, another size, fewer bytes than needed): the runs then travel as
        payload frames. Only what the transfer writes is mapped: a decode worker's
        segment is sized for its largest transfer, and its page tables cost ~30 ms per
        256 MiB (docs/benchmarks.md)."""
        if not self._host_id or not isinstance(offer, dict) or needed <= 0:
            return None
        name, nbytes = offer.get("name"), offer.get("bytes")
        if offer.get("host_id") != self._host_id or not isinstance(name, str):
            return None
        if not _SEGMENT_NAME.fullmatch(name) or not isinstance(nbytes, int) or nbytes < needed:
            return None
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)  # never creates one
        except OSError:
            return None
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_size != nbytes:
                return None
            length = min(nbytes, -(-needed // mmap.PAGESIZE) * mmap.PAGESIZE)
            return self._mapping(fd, name, (found.st_dev, found.st_ino), length)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def drop_unlinked(self) -> None:
        with self._lock:
            kept = [(key, name) for key, (name, _) in self._maps.items()]
        gone = [key for key, name in kept if _inode(SHM_DIR / name) != key]
        with self._lock:
            for key in gone:
                dropped = self._maps.pop(key, None)
                if dropped is not None:
                    self._bytes -= dropped[1].nbytes

    def _mapping(self, fd: int, name: str, key: tuple[int, int], length: int) -> torch.Tensor:
        """A kept mapping of at least ``length`` bytes of the file, else a new one (kept
        in place of a shorter one)."""
        with self._lock:
            kept = self._maps.get(key)
            if kept is not None and kept[1].nbytes >= length:
                self._maps.move_to_end(key)
                return kept[1]
        memory = _mapped(fd, length)
        with self._lock:
            shorter = self._maps.pop(key, None)
            if shorter is not None:
                self._bytes -= shorter[1].nbytes
            if length <= self._keep_bytes:
                self._maps[key] = (name, memory)
                self._bytes += length
            while self._bytes > self._keep_bytes:
                _, (_, dropped) = self._maps.popitem(last=False)
                self._bytes -= dropped.nbytes
        return memory


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        found = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def place_runs(segment: torch.Tensor, offset: int, runs: list[torch.Tensor]) -> None:
    """Prefill side: copy ``runs`` one after the other into ``segment`` from ``offset``."""
    for run in runs:
        source = run.contiguous().view(torch.uint8).reshape(-1)
        end = offset + source.nbytes
        if offset < 0 or end > segment.nbytes:
            raise ValueError("a run does not fit the decode worker's segment")
        segment[offset:end].copy_(source)
        offset = end


class ShmLanding:
    """Decode side: one transfer's segment, blocks ``[first_block, num_blocks)``; runs
    the prefill side placed are read in place, payload frames through ``fallback``."""

    def __init__(
        self, layout: KVBlockLayout, name: str, segment: torch.Tensor, first_block: int,
        fallback: PayloadLanding, own_host_id: str,
    ) -> None:  # fmt: skip
        self._layout = layout
        self._name = name
        self._segment = segment
        self._first_block = first_block
        self._host_id = own_host_id
        self._fallback = fallback

    def request_fields(self) -> dict[str, Any]:
        offer = {"name": self._name, "bytes": self._segment.nbytes, "host_id": self._host_id}
        return {"shm": offer}

    def run_blocks(
        self, header: dict[str, Any], payload_len: int, sock: socket.socket
    ) -> torch.Tensor:
        if not header.get("placed"):
            return self._fallback.run_blocks(header, payload_len, sock)
        if payload_len:
            raise ValueError(f"a placed run {header!r} with a payload")
        size = self._layout.block_nbytes
        start = (int(header["first_block"]) - self._first_block) * size
        end = start + int(header["num_blocks"]) * size
        if start < 0 or end > self._segment.nbytes:
            raise ValueError(f"run {header!r} lies outside the shared segment")
        # Each slot is written once, before its frame: installing from it in place is safe.
        run = self._segment[start:end]
        return run.view(self._layout.torch_dtype).reshape(-1, *self._layout.block_shape)

    def give_back(self, run: torch.Tensor) -> None:
        if run.untyped_storage().data_ptr() != self._segment.untyped_storage().data_ptr():
            self._fallback.give_back(run)
