"""The stream sockets between a router's processes, and the announcements sent over them.

With ``--processes N`` every process routes on its own copy of the policy: the processes
are router replicas on one port. They tell each other their routing exactly as replicas
on separate ports do (:mod:`kvserve.core.routing.announcements`): each choice with what
the policy records of it (cache_aware the prompt's text, kv_aware its blocks and the
prefill queued), each undo, applied through ``Policy.observe_peer_choice`` and its
take-back. So a prompt routed by process A is matched by process B from the moment B's
loop reads the announcement: on a loopback socket, well under a millisecond later,
before any client could send the next turn of the conversation.

What siblings do not need is announced loads: their guards are summed exactly in the
shared-memory table (:mod:`kvserve.router.shared_loads`), so the announced values are
never added to a load. A kv_aware process still announces its own guards per worker, as
the notice on which its siblings re-read that worker's total from the table into their
load order (the other policies read loads only from the table, and announce none).

The parent makes one ``socketpair`` per pair of processes before forking, so the links
need no addresses and no connecting (nor, unlike peers, renaming: every process
registers the same workers in the same order, so worker ids agree). The links also carry
the metrics' requests and replies (``sibling_metrics.py``) and the fleet's changes
(``fleet_changes.py``). Messages are
length-prefixed JSON announcements, one per loop iteration (however many requests were
routed meanwhile), written to every sibling.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import orjson

from kvserve.core.routing.announcements import Announcement, Announcer, PeerView

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")


class SiblingLinks:
    """This process's ends of its links to every sibling process: framed messages."""

    def __init__(self, sockets: Sequence[socket.socket], index: int = 0) -> None:
        self._sockets = list(sockets)  # to each sibling, in the order of their indices
        self._index = index  # this process's
        # One reader per link, made before any link is read: a message (a metrics
        # request) can arrive on a link, and be answered on it, while the later links
        # are still being set up.
        self._readers: list[_MessageReader] = []

    def link_to(self, process: int) -> int:
        """The number of the link to sibling ``process`` (for :meth:`send_to`)."""
        if process == self._index:
            raise ValueError("a process has no link to itself")
        return process if process < self._index else process - 1

    @property
    def count(self) -> int:
        """How many siblings this process has."""
        return len(self._sockets)

    async def start(self, on_message: Callable[[Any, int], None]) -> None:
        """Start reading every sibling's messages (each decoded and handed to
        ``on_message`` with the number of the link it came on, for :meth:`send_to`)."""
        loop = asyncio.get_running_loop()
        self._readers = [
            _MessageReader(functools.partial(_from_link, on_message, link))
            for link in range(len(self._sockets))
        ]
        for reader, sock in zip(self._readers, self._sockets, strict=True):
            sock.setblocking(False)
            await loop.create_unix_connection(functools.partial(_itself, reader), sock=sock)

    def send(self, message: object) -> None:
        """Write ``message`` to every sibling (buffered by the transports, not awaited)."""
        data = _framed(message)
        for reader in self._readers:
            reader.write(data)

    def send_to(self, link: int, message: object) -> None:
        """Write ``message`` to the sibling on ``link`` only."""
        self._readers[link].write(_framed(message))

    def close(self) -> None:
        for reader in self._readers:
            reader.close()


def _from_link(on_message: Callable[[Any, int], None], link: int, message: object) -> None:
    on_message(message, link)


def _itself(reader: _MessageReader) -> _MessageReader:
    return reader


def _framed(message: object) -> bytes:
    payload = orjson.dumps(message)
    return _LENGTH.pack(len(payload)) + payload


class _MessageReader(asyncio.Protocol):
    """One link: splits the sibling's byte stream into messages, and writes to it."""

    def __init__(self, on_message: Callable[[Any], None]) -> None:
        self._on_message = on_message
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def write(self, data: bytes) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, start)
            end = start + _LENGTH.size + length
            if len(buffer) < end:
                break
            message = orjson.loads(memoryview(buffer)[start + _LENGTH.size : end])
            start = end
            try:
                self._on_message(message)
            except Exception:  # a bug handling one message must not cut the link
                log.exception("a sibling router process's message failed")
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        # A sibling gone (or the group stopping): the parent sees a death and stops all.
        if exc is not None:
            log.warning("the link to a sibling router process broke: %s", exc)


class SiblingAnnouncements:
    """This process's announcements to its siblings, and theirs applied to its policy.

    ``view`` records the siblings' choices (its ``on_load`` hears the workers whose
    sibling guards changed); :attr:`announcer` is what the routing policy announces to
    (wrapped in :class:`~kvserve.core.routing.announcing_policy.AnnouncingPolicy`)."""

    def __init__(
        self,
        links: SiblingLinks,
        index: int,
        view: PeerView,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._links = links
        self.view = view
        self._clock = clock
        # One host, one monotonic clock: each choice is applied as of its origin's time.
        self.announcer = Announcer(f"process-{index}", on_note=self._schedule, stamp_times=True)
        self._flush_scheduled = False

    async def start(self, on_other: Callable[[Any, int], bool] | None = None) -> None:
        """Apply the siblings' announcements; a message ``on_other`` takes (returns True
        for) is not one: the links carry the metrics' requests and replies too."""

        def receive(message: object, link: int) -> None:
            if on_other is None or not on_other(message, link):
                self._receive(message)

        await self._links.start(receive)

    def _schedule(self) -> None:
        """A note was taken: send everything noted this loop iteration once it ends."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        announcement = self.announcer.take()
        if not announcement.is_empty():
            self._links.send(announcement.to_json())

    def _receive(self, message: object) -> None:
        try:
            announcement = Announcement.from_json(message)
        except ValueError as error:  # the same code sent it: a bug, not an attack
            log.error("dropped a sibling process's announcement: %s", error)
            return
        self.view.apply(announcement, self._clock())
