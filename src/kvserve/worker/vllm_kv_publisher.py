"""``--kv-events-publisher``: the worker's KV events on ZMQ in vLLM's wire format, so that
routers built for vLLM fleets (NVIDIA Dynamo, llm-d, a kvserve router with ``--kv-events
tcp://...``) can route kvserve workers too. The HTTP stream (``/kv/events``) goes on
beside it.

The publisher follows the worker's one event log like an HTTP subscriber does: it waits
for new events, takes them from the engine thread, and publishes them as one batch under
the next sequence number (from 0 per process). Only the device tier is published, as
vLLM publishes its GPU blocks: ``BlockStored`` with the blocks' token ids (which a
foreign router hashes its own way), ``BlockRemoved``, ``AllBlocksCleared``. The block
names are kvserve's chain hashes as unsigned ints. Should the log's bounded history pass
the publisher by, it publishes ``AllBlocksCleared`` (subscribers forget this worker's
blocks, the safe side) and goes on from the log's end.

With ``--kv-events-replay``, a ROUTER socket answers a subscriber that saw a gap with the
last 10,000 batches, as vLLM's does (format: :mod:`kvserve.core.vllm_kv_wire`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from kvserve.core.kv_events import EventGapError, KVEvent
from kvserve.core.vllm_kv_wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    VllmEvent,
    decode_seq,
    encode_batch,
    encode_seq,
)
from kvserve.worker.engine_bridge import EngineBridge

log = logging.getLogger(__name__)

PUBLISHED_TIER = "device"
REPLAY_STEPS = 10_000
_WAIT_S = 1.0


def vllm_events(events: Sequence[KVEvent], block_size: int) -> list[VllmEvent]:
    """The device tier's events in vLLM's terms (other tiers are not published)."""
    out: list[VllmEvent] = []
    for event in events:
        if event.tier != PUBLISHED_TIER:
            continue
        if event.kind == "stored":
            out.append(
                BlockStored(event.block_hashes, event.parent_hash, event.token_ids, block_size)
            )
        elif event.kind == "removed":
            out.append(BlockRemoved(event.block_hashes))
        else:
            out.append(AllBlocksCleared())
    return out


def _since(seq: int, engine: Any) -> list[KVEvent]:
    """The log's events after ``seq`` (run on the engine thread)."""
    events: list[KVEvent] = engine.events.since(seq)
    return events


def bind_or_connect(socket: zmq.asyncio.Socket, endpoint: str) -> None:
    """vLLM's rule: a wildcard host or an ipc/inproc path binds, a named host connects."""
    if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


class VllmKVPublisher:
    def __init__(
        self,
        bridge: EngineBridge,
        endpoint: str,
        block_size: int,
        *,
        replay_endpoint: str | None = None,
        topic: str = "kv",
    ) -> None:
        self._bridge = bridge
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._block_size = block_size
        self._topic = topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_STEPS)
        self._next_seq = 0
        self._context: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None

    def open(self) -> None:
        """Bind (or connect) the sockets now, so that a taken port fails the worker's
        start instead of silently leaving it unpublished."""
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            bind_or_connect(self._pub, self._endpoint)
            if self._replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self._replay_endpoint)
        except zmq.ZMQError:
            self.close()
            raise

    def close(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._replay = None
        if self._context is not None:
            self._context.term()
            self._context = None

    async def run(self) -> None:
        """Publish until cancelled (after :meth:`open`)."""
        assert self._pub is not None, "open() first"
        replaying = (
            asyncio.create_task(self._serve_replay(self._replay))
            if self._replay is not None
            else None
        )
        try:
            await self._publish_forever(self._pub)
        finally:
            if replaying is not None:
                replaying.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await replaying

    async def _publish_forever(self, pub: zmq.asyncio.Socket) -> None:
        after = 0
        while True:
            await self._bridge.wait_for_events(after, _WAIT_S)
            if self._bridge.state.events_last_seq <= after:
                continue
            try:
                events = await self._bridge.call(functools.partial(_since, after))
            except EventGapError:
                log.warning("kv events publisher fell behind the log; publishing a clear")
                after = self._bridge.state.events_last_seq
                await self._send(pub, [AllBlocksCleared()])
                continue
            if not events:
                continue
            after = events[-1].seq
            batch = vllm_events(events, self._block_size)
            if batch:
                await self._send(pub, batch)

    async def _send(self, pub: zmq.asyncio.Socket, events: list[VllmEvent]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(EventBatch(time.time(), tuple(events), 0))
        self._buffer.append((seq, payload))
        await pub.send_multipart([self._topic, encode_seq(seq), payload])

    async def _serve_replay(self, replay: zmq.asyncio.Socket) -> None:
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:
                continue  # not a replay request: nothing to answer
            client, _, start_frame = frames
            try:
                start = decode_seq(start_frame)
            except ValueError:
                continue
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await replay.send_multipart(
                        [client, b"", self._topic, encode_seq(seq), payload]
                    )
            await replay.send_multipart([client, b"", b"", END_SEQ, b""])
