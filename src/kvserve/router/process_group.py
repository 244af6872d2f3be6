"""``kvserve router --processes N``: N router processes on one port, one supervisor.

One Python process serves on one core; the parent forks ``N`` children that each bind the
router's port with ``SO_REUSEPORT`` (the kernel spreads new connections over them) and
serve it as the single-process router does, sharing what routing must agree on:

- load: a :class:`~kvserve.router.shared_loads.SharedLoadTable` in shared memory, so
  every process's guards and policy read the fleet's total in-flight load;
- the policy's predictions (cache_aware's prefix tree; kv_aware's queued prefills,
  expected blocks and load order): each decision's records go to every sibling over
  :class:`~kvserve.router.sibling_links.SiblingLinks`.

The parent serves nothing. It stops every child on SIGTERM or SIGINT, and when a child
dies on its own it stops the rest and exits with an error (the router then restarts
whole under its own supervisor, with a consistent table and trees, rather than run on
with a process whose held load and tree records died with it). Children get SIGTERM when
the parent dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.router.config import RouterConfig
from kvserve.router.shared_loads import SharedLoadTable
from kvserve.router.sibling_links import SiblingLinks

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Workers that can be added at run time (POST /workers) beyond the starting fleet: ids are
# never reused, so each addition takes a slot of the shared table for the router's life.
SPARE_WORKER_SLOTS = 1024


@dataclass(frozen=True)
class ProcessMember:
    """What one child knows of its group: its index, the shared table, its links."""

    index: int
    count: int
    table: SharedLoadTable
    links: SiblingLinks


def run_process_group(config: RouterConfig, serve: Callable[[ProcessMember], None]) -> int:
    """Fork ``config.processes`` children running ``serve`` and supervise them; returns
    the exit status for the whole router (0 after a requested stop)."""
    count = config.processes
    _check_port_free(config.host, config.port)
    fleet = (*config.worker_urls, *config.prefill_urls, *config.decode_urls)
    # One slot per worker, as registered; spare slots for the workers added at run time.
    table = SharedLoadTable(count, len(fleet) + SPARE_WORKER_SLOTS)
    pairs = {(a, b): socket.socketpair() for a in range(count) for b in range(a + 1, count)}
    children: dict[int, int] = {}
    parent = os.getpid()
    for index in range(count):
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _run_child(index, count, table, pairs, serve, parent)
        children[pid] = index
    for pair in pairs.values():
        for sock in pair:
            sock.close()
    return _supervise(children)


def _check_port_free(host: str, port: int) -> None:
    """Refuse a port someone already serves. The children bind it with ``SO_REUSEPORT``,
    which would let them silently share it with another router that did too; a bind
    without that option fails instead. (Released before the children bind.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise OSError(f"cannot serve on {host}:{port}: {error.strerror}") from error


def _run_child(
    index: int,
    count: int,
    table: SharedLoadTable,
    pairs: dict[tuple[int, int], tuple[socket.socket, socket.socket]],
    serve: Callable[[ProcessMember], None],
    parent: int,
) -> None:
    status = 1
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        _terminate_with_parent()
        if os.getppid() != parent:
            return  # the parent died before the request took effect
        mine = []  # in the order of the siblings' indices: the pairs are (a, b), a < b, sorted
        for (a, b), (end_a, end_b) in pairs.items():
            if index in (a, b):
                mine.append(end_a if index == a else end_b)
                (end_b if index == a else end_a).close()
            else:
                end_a.close()
                end_b.close()
        serve(ProcessMember(index, count, table, SiblingLinks(mine, index)))
        status = 0
    except BaseException:  # a child must never return into the parent's code
        log.exception("router process %d failed", index)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _terminate_with_parent() -> None:
    """SIGTERM this child when the parent dies (Linux), so none outlives a killed router."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return


def _supervise(children: dict[int, int]) -> int:
    """Wait for every child; the first to die unasked stops the others."""
    stopping = False

    def stop_all(signum: int = signal.SIGTERM, _frame: object = None) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    status = 0
    while children:
        pid, wait_status = os.wait()
        index = children.pop(pid, None)
        if index is None:
            continue
        code = os.waitstatus_to_exitcode(wait_status)
        if not stopping:
            log.error(
                "router process %d (pid %d) exited with %d: stopping the others", index, pid, code
            )
            status = 1
            stop_all()
    return status
