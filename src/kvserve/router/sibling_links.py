"""The stream sockets between a router's processes, and the records sent over them.

With ``--processes N`` every process routes on its own copy of the policy. A cache_aware
decision records the prompt in the deciding process's prefix tree; :class:`SiblingLinks`
sends that record (and its take-back, should the attempt fail before its first token) to
every sibling, which applies it to its own tree on its event loop. So a prompt routed by
process A is matched by process B from the moment B's loop reads the record: on a
loopback socket, well under a millisecond later, before any client could send the next
turn of the conversation. kv_aware's own predictions (the prefill it queues on a worker,
the blocks it expects there, their take-backs) travel the same way, and so does each
change of a process's guards, which the siblings' load orders re-read from the shared
table (the workers' KV events each process follows itself).

The parent makes one ``socketpair`` per pair of processes before forking, so the links
need no addresses and no connecting; records are length-prefixed JSON arrays, batched
per loop iteration (one write per sibling however many requests were routed meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from kvserve.core.routing.kv_aware import KvAwareRouting
from kvserve.core.routing.policies.cache_aware import CacheAwarePolicy
from kvserve.core.routing.types import WorkerLoad

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
Record = list[Any]


class SiblingLinks:
    """This process's ends of its links to every sibling process."""

    def __init__(self, sockets: Sequence[socket.socket]) -> None:
        self._sockets = list(sockets)
        self._transports: list[asyncio.Transport] = []
        self._pending: list[bytes] = []
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, on_record: Callable[[Record], None]) -> None:
        """Start reading every sibling's records (each handed to ``on_record``)."""
        self._loop = asyncio.get_running_loop()
        for sock in self._sockets:
            sock.setblocking(False)
            transport, _ = await self._loop.create_unix_connection(
                lambda: _RecordReader(on_record), sock=sock
            )
            self._transports.append(transport)

    def send(self, record: Record) -> None:
        """Queue ``record`` for every sibling; written once this loop iteration ends."""
        payload = orjson.dumps(record)
        self._pending.append(_LENGTH.pack(len(payload)) + payload)
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        data = b"".join(self._pending)
        self._pending.clear()
        for transport in self._transports:
            if not transport.is_closing():
                transport.write(data)

    def close(self) -> None:
        for transport in self._transports:
            transport.close()


class _RecordReader(asyncio.Protocol):
    """Splits a sibling's byte stream into records."""

    def __init__(self, on_record: Callable[[Record], None]) -> None:
        self._on_record = on_record
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, start)
            end = start + _LENGTH.size + length
            if len(buffer) < end:
                break
            self._on_record(orjson.loads(memoryview(buffer)[start + _LENGTH.size : end]))
            start = end
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        # A sibling gone (or the group stopping): the parent sees a death and stops all.
        if exc is not None:
            log.warning("the link to a sibling router process broke: %s", exc)


class TreeReplication:
    """Copies a cache_aware policy's tree records to the siblings and applies theirs."""

    def __init__(self, policy: CacheAwarePolicy, links: SiblingLinks) -> None:
        self._policy = policy
        self._links = links
        policy.replica = self

    def inserted(self, pool: str, model: str, text: str, worker_id: str, now: float) -> None:
        self._links.send(["i", pool, model, text, worker_id, now])

    def untagged(self, pool: str, model: str, text: str, worker_id: str, held: int) -> None:
        self._links.send(["u", pool, model, text, worker_id, held])

    def apply(self, record: Record) -> None:
        """A sibling's record, applied to this process's tree."""
        kind, pool, model, text, worker_id, value = record
        if kind == "i":
            self._policy.apply_insert(pool, model, text, worker_id, value)
        else:
            self._policy.apply_untag(pool, model, text, worker_id, value)


class KvReplication:
    """Copies a kv_aware routing's predictions and this process's guard changes to the
    siblings, and applies theirs."""

    def __init__(
        self,
        routing: KvAwareRouting,
        links: SiblingLinks,
        fleet_load: Callable[[str], WorkerLoad],
    ) -> None:
        self._routing = routing
        self._links = links
        self._fleet_load = fleet_load  # a worker's load summed over every process
        routing.replica = self

    def queued(self, worker_id: str, seconds: float, now: float) -> None:
        self._links.send(["q", worker_id, seconds, now])

    def unqueued(self, worker_id: str, seconds: float, ends_at: float, now: float) -> None:
        self._links.send(["Q", worker_id, seconds, ends_at, now])

    def speculated(self, worker_id: str, block_hashes: Sequence[int], deadline: float) -> None:
        self._links.send(["s", worker_id, list(block_hashes), deadline])

    def withdrawn(self, worker_id: str, block_hashes: Sequence[int], deadline: float) -> None:
        self._links.send(["w", worker_id, list(block_hashes), deadline])

    def load_changed(self, worker_id: str) -> None:
        """This process's guards on ``worker_id`` changed (the table has the new total)."""
        self._links.send(["l", worker_id])

    def apply(self, record: Record) -> None:
        """A sibling's record, applied to this process's routing."""
        kind, worker_id, *rest = record
        routing = self._routing
        if kind == "l":
            routing.loads.update(self._fleet_load(worker_id))
        elif kind == "q":
            routing.apply_queued(worker_id, *rest)
        elif kind == "Q":
            routing.apply_unqueued(worker_id, *rest)
        elif kind == "s":
            routing.index.speculate(worker_id, rest[0], rest[1])
        else:
            routing.index.withdraw(worker_id, rest[0], rest[1])
