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

import mmap
import os
import re
import secrets
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvserve.engine.kv_block_io import KVBlockLayout

if TYPE_CHECKING:
    from kvserve.worker.tcp_kv_transfer import PayloadLanding

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "kvserve-pd-"
_SEGMENT_NAME = re.compile(r"kvserve-pd-\d+-[0-9a-f]{16}")


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


def create_segment(nbytes: int) -> tuple[str, torch.Tensor]:
    """A fresh segment of ``nbytes``: its name and its memory. Its pages are allocated
    here (``posix_fallocate``), so a full ``/dev/shm`` fails this call (``OSError``; the
    transfer then uses payload frames) instead of the peer's write (``SIGBUS``)."""
    name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return name, _mapped(fd, nbytes)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)  # the mapping keeps the pages


def unlink_segment(name: str) -> None:
    """The segment's name is gone; its pages go with the last mapping of them."""
    (SHM_DIR / name).unlink(missing_ok=True)


def open_segment(offer: Any, own_host_id: str) -> torch.Tensor | None:
    """Prefill side: the decode worker's segment ``offer`` mapped here, or None if it is
    not one this host can serve (another host, a bad name, a missing file, another
    size): the runs then travel as payload frames."""
    if not isinstance(offer, dict) or offer.get("host_id") != own_host_id or not own_host_id:
        return None
    name, nbytes = offer.get("name"), offer.get("bytes")
    if not isinstance(name, str) or not _SEGMENT_NAME.fullmatch(name):
        return None
    if not isinstance(nbytes, int) or nbytes <= 0:
        return None
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)  # never creates one
    except OSError:
        return None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_size != nbytes:
            return None
        return _mapped(fd, nbytes)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


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
