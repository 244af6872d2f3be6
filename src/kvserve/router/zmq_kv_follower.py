"""Follows one worker's KV events from a ZMQ publisher in vLLM's format into the policy.

vLLM, SGLang and kvserve's ``--kv-events-publisher`` publish one message per scheduler
step, numbered from 0 (:mod:`kvserve.core.vllm_kv_wire`). PUB/SUB drops messages when a
subscriber is slow or not yet connected, so the sequence number is checked on every
message:

- **gap** (a number skipped): the missing steps are asked of the replay socket when one
  is given, and applied in order; without one, or when the replay no longer has them,
  the worker's index is dropped and rebuilt from new events (chains whose start was
  missed stay unknown until they are stored again: the index under-reports, never
  over-reports).
- **restart**: ZMQ reconnects by itself, and the socket monitor reports the disconnect:
  the worker's cache is gone with its process, so its index is dropped at once. On every
  connect the follower replays from where it is (from 0 after a drop), which also covers
  the messages a SUB socket misses while its subscription propagates. A sequence that
  starts again without a disconnect seen is a restart too.

Blocks are renamed into kvserve's hashes by :class:`ForeignBlockMap` (the reason is in
its module); the block size is learned from the first ``BlockStored``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.foreign_blocks import ForeignBlockMap
from kvserve.core.routing.kv_index import TIERS
from kvserve.core.routing.policy import Policy
from kvserve.core.vllm_kv_wire import (
    END_SEQ,
    EventBatch,
    WireFormatError,
    decode_batch,
    decode_seq,
    replay_request,
)
from kvserve.router.kv_event_source import ZmqEventSource

log = logging.getLogger(__name__)

_CONNECTION_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class ZmqKVFollower:
    """One worker's publisher → ``policy.observe_events``. Counters are for metrics and
    tests: ``gaps`` seen, ``replays`` that filled one, ``drops`` of the whole index."""

    def __init__(
        self,
        worker_id: str,
        source: ZmqEventSource,
        policy: Policy,
        context: zmq.asyncio.Context,
        model: str,
        *,
        on_block_size: Callable[[int], None] | None = None,
        block_size: int | None = None,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.worker_id = worker_id
        self.source = source
        self._policy = policy
        self._context = context
        self._on_block_size = on_block_size
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self.blocks = ForeignBlockMap(model, block_size)
        self._reported_block_size: int | None = None
        self.next_seq: int | None = None  # None: take the next message as the start
        self._replayed_through = -1  # live copies of these were applied from a replay
        self.gaps = 0
        self.replays = 0
        self.drops = 0
        self.bad_messages = 0

    async def run(self) -> None:
        """Follow until cancelled."""
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: vLLM's is configurable
        monitor = sub.get_monitor_socket(_CONNECTION_EVENTS)
        sub.connect(self.source.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                for socket, _ in await poller.poll():
                    if socket is monitor:
                        frames = await monitor.recv_multipart()
                        await self._on_connection(parse_monitor_message(frames)["event"])
                    else:
                        await self.on_message(await sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_connection(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            log.info("kv events of %s: publisher gone; its index is dropped", self.worker_id)
            self.drop()
        elif event == zmq.EVENT_CONNECTED and self.source.replay is not None:
            await self._catch_up(0 if self.next_seq is None else self.next_seq)

    def drop(self) -> None:
        """Forget everything this worker was said to hold; the next message starts anew."""
        self.blocks.clear()
        for tier in TIERS:
            self._policy.observe_snapshot(self.worker_id, tier, ())
        self.next_seq = None
        self._replayed_through = -1
        self.drops += 1

    async def on_message(self, frames: list[bytes]) -> None:
        """One live message: applied in order, after a replay if some were missed."""
        try:
            if len(frames) != 3:
                raise WireFormatError(f"{len(frames)} frames, expected 3")
            seq, batch = decode_seq(frames[1]), decode_batch(frames[2])
        except WireFormatError as error:
            self.bad_messages += 1
            log.warning("kv events of %s: %s; dropping its index", self.worker_id, error)
            self.drop()
            return
        if self.next_seq is not None and seq < self.next_seq:
            if seq <= self._replayed_through:
                return  # applied from the replay already
            log.info("kv events of %s: sequence began again; publisher restarted", self.worker_id)
            self.drop()
            if self.source.replay is not None:
                await self._catch_up(0)
                if self.next_seq is not None and seq < self.next_seq:
                    return
        if self.next_seq is not None and seq > self.next_seq:
            self.gaps += 1
            if self.source.replay is not None:
                await self._catch_up(self.next_seq)
            if self.next_seq is not None and seq < self.next_seq:
                return  # the replay brought it
            if self.next_seq is not None and seq > self.next_seq:
                lost = f"{self.next_seq}..{seq - 1}"
                log.info("kv events of %s: steps %s lost", self.worker_id, lost)
                self.drop()
        self._apply(seq, batch)

    def _apply(self, seq: int, batch: EventBatch) -> None:
        events: list[KVEvent] = []
        for event in batch.events:
            events.extend(self.blocks.translate(seq, event))
        learned = self.blocks.block_size
        self._policy.observe_events(self.worker_id, events)
        self.next_seq = seq + 1
        if learned != self._reported_block_size and learned is not None:
            self._reported_block_size = learned
            if self._on_block_size is not None:
                self._on_block_size(learned)

    async def _catch_up(self, start: int) -> None:
        """Apply what the replay socket holds from ``start`` on. If its oldest step is
        past ``start``, what came between is lost: the index is dropped first."""
        replayed = await self._replay(start)
        if not replayed:
            return
        self.replays += 1
        if replayed[0][0] > start and self.next_seq is not None:
            self.drop()
        for seq, batch in replayed:
            if self.next_seq is None or seq >= self.next_seq:
                self._apply(seq, batch)
                self._replayed_through = seq

    async def _replay(self, start: int) -> list[tuple[int, EventBatch]]:
        """The buffered steps from ``start`` on, oldest first; empty when the replay
        socket does not answer in time or answers nonsense."""
        assert self.source.replay is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.source.replay)
        steps: list[tuple[int, EventBatch]] = []
        try:
            await dealer.send_multipart(replay_request(start))
            while True:
                if not await dealer.poll(self._replay_timeout_ms):
                    log.info("kv events of %s: replay did not answer", self.worker_id)
                    return []
                # vLLM: [b"", topic, seq, payload]; SGLang leaves the topic out.
                frames = (await dealer.recv_multipart())[1:]
                if len(frames) not in (2, 3):
                    raise WireFormatError(f"replay answer of {len(frames) + 1} frames")
                seq_frame, payload = frames[-2:]
                if seq_frame == END_SEQ:
                    return steps
                steps.append((decode_seq(seq_frame), decode_batch(payload)))
        except WireFormatError as error:
            log.warning("kv events of %s: replay: %s", self.worker_id, error)
            return []
        finally:
            dealer.close(linger=0)
