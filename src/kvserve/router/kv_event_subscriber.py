"""Follows every worker's KV event stream, of every pool, into the routing policy.

One task per worker: take ``/kv/snapshot`` (replace that worker's view of every tier),
then long-poll ``/kv/events?after=SEQ`` and apply each event in order. A ``410`` (the
worker's bounded history passed us by, or it restarted) or a sequence gap means resync
from a snapshot: the index never silently skips an event. Polls are spaced ``batch_s``
apart while events flow, so following a busy fleet costs a few requests per second per
worker. An unreachable worker is retried with backoff and, being possibly restarted,
resynced. The fleet is reconciled with the registry every ``reconcile_s``: new workers
are followed, removed ones forgotten (the policy's state and the task). The policy gets
each snapshot's tiers (``observe_snapshot``) and each poll's events, in order
(``observe_events``): the calls the simulator makes for its simulated workers.
Wire format: docs/internals.md, "Worker KV events API".

A worker registered with a ZMQ event source (``--kv-events tcp://...``: vLLM, SGLang, or
a kvserve worker's ``--kv-events-publisher``) is followed by a
:class:`~kvserve.router.zmq_kv_follower.ZmqKVFollower` instead; its served models come
from ``/v1/models`` and its block size from its events (or ``block_size``, when given).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import zmq.asyncio

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.kv_index import TIERS
from kvserve.core.routing.policy import Policy
from kvserve.router.worker_registry import Worker, WorkerRegistry
from kvserve.router.zmq_kv_follower import ZmqKVFollower

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerKVInfo:
    """What a resync learns besides the blocks: the models served, the block size."""

    models: tuple[str, ...]
    block_size: int


def _tiers_of(snapshot: dict[str, Any]) -> dict[str, list[list[int]]]:
    """Every tier's blocks in a snapshot. The snapshot is the worker's whole state, so a
    tier it does not list (a worker without a host tier, or one from before ``tiers``
    existed) holds nothing: replacing it by nothing drops what an earlier process held."""
    listed = {snapshot["tier"]: snapshot["blocks"], **snapshot.get("tiers", {})}
    return {tier: listed.get(tier, []) for tier in TIERS}


class _Resync(Exception):
    """The stream cannot be continued incrementally."""


class KVEventSubscriber:
    def __init__(
        self,
        policy: Policy,
        registry: WorkerRegistry,
        session: aiohttp.ClientSession | None,
        *,
        on_worker_info: Callable[[str, WorkerKVInfo], None] | None = None,
        poll_timeout_s: float = 10.0,
        batch_s: float = 0.05,
        reconcile_s: float = 1.0,
        retry_s: float = 0.5,
        block_size: int | None = None,
    ) -> None:
        self._policy = policy
        self._registry = registry
        self._session = session
        self._on_worker_info = on_worker_info
        self._poll_timeout_s = poll_timeout_s
        self._batch_s = batch_s
        self._reconcile_s = reconcile_s
        self._retry_s = retry_s
        self._block_size = block_size  # overrides what ZMQ events say
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._zmq_context: zmq.asyncio.Context | None = None
        self.zmq_followers: dict[str, ZmqKVFollower] = {}
        self.last_seq: dict[str, int] = {}
        self.resyncs: dict[str, int] = {}

    async def run_forever(self) -> None:
        try:
            while True:
                self.reconcile()
                await asyncio.sleep(self._reconcile_s)
        finally:
            await self.stop()

    def reconcile(self) -> None:
        """Follow workers that joined, forget those that left."""
        current = {w.worker_id: w for w in self._registry.all()}
        for worker_id in [w for w in self._tasks if w not in current]:
            self._tasks.pop(worker_id).cancel()
            self._policy.forget_worker(worker_id)
            self.last_seq.pop(worker_id, None)
            self.zmq_followers.pop(worker_id, None)
        for worker_id, worker in current.items():
            if worker_id not in self._tasks:
                follow = self._follow if worker.kv_events is None else self._follow_zmq
                self._tasks[worker_id] = asyncio.create_task(follow(worker))

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._zmq_context is not None:
            self._zmq_context.term()
            self._zmq_context = None

    async def _follow(self, worker: Worker) -> None:
        while True:
            try:
                await self._resync(worker)
                while True:
                    await self._poll(worker)
            except _Resync:
                self.resyncs[worker.worker_id] = self.resyncs.get(worker.worker_id, 0) + 1
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as error:
                log.debug("kv events of %s: %s; retrying", worker.worker_id, error)
                await asyncio.sleep(self._retry_s)

    async def _follow_zmq(self, worker: Worker) -> None:
        """A ZMQ publisher's events, once the worker says which model it serves (the
        namespace of its blocks): asked again until it answers."""
        while True:
            try:
                answer = await self._get(worker, "/v1/models", 0.0)
                models = tuple(str(m["id"]) for m in answer["data"])
                if models:
                    break
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, _Resync) as error:
                log.debug("models of %s: %s; retrying", worker.worker_id, error)
            await asyncio.sleep(self._retry_s)

        def learned(block_size: int) -> None:
            if self._on_worker_info is not None:
                self._on_worker_info(worker.worker_id, WorkerKVInfo(models, block_size))

        assert worker.kv_events is not None
        if self._zmq_context is None:
            self._zmq_context = zmq.asyncio.Context()
        follower = ZmqKVFollower(
            worker.worker_id,
            worker.kv_events,
            self._policy,
            self._zmq_context,
            models[0],
            on_block_size=None if self._block_size is not None else learned,
            block_size=self._block_size,
        )
        self.zmq_followers[worker.worker_id] = follower
        if self._block_size is not None:
            learned(self._block_size)
        await follower.run()

    async def _get(self, worker: Worker, path: str, timeout_s: float) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s + 5.0)
        assert self._session is not None, "a subscriber without a session only applies"
        async with self._session.get(worker.url + path, timeout=timeout) as response:
            if response.status == 410:
                raise _Resync
            response.raise_for_status()
            return await response.json()

    async def _resync(self, worker: Worker) -> None:
        snapshot = await self._get(worker, "/kv/snapshot", 0.0)
        if self._on_worker_info is not None:
            models = await self._get(worker, "/v1/models", 0.0)
            info = WorkerKVInfo(
                tuple(str(m["id"]) for m in models["data"]), int(snapshot["block_size"])
            )
            self._on_worker_info(worker.worker_id, info)
        self.apply_snapshot(worker.worker_id, snapshot)

    def apply_snapshot(self, worker_id: str, snapshot: dict[str, Any]) -> None:
        """A ``/kv/snapshot`` answer: the store the worker loads from (``storage_id``, absent
        for none), every tier replaced, the stream continues after it."""
        self._policy.observe_store(worker_id, snapshot.get("storage_id"))
        for tier, blocks in _tiers_of(snapshot).items():
            self._policy.observe_snapshot(worker_id, tier, [block[0] for block in blocks])
        self.last_seq[worker_id] = int(snapshot["last_seq"])

    def apply_events(self, worker_id: str, raw_events: Sequence[dict[str, Any]]) -> None:
        """A ``/kv/events`` answer's events, in order; those after a sequence gap are not
        applied and the stream must resync (``_Resync``)."""
        after = self.last_seq[worker_id]
        events: list[KVEvent] = []
        for raw in raw_events:
            event = KVEvent(
                int(raw["seq"]),
                raw["kind"],
                raw["tier"],
                tuple(raw["block_hashes"]),
                raw["parent_hash"],
            )
            if event.seq != after + 1:
                break
            events.append(event)
            after = event.seq
        self._policy.observe_events(worker_id, events)
        self.last_seq[worker_id] = after
        if len(events) < len(raw_events):
            raise _Resync

    async def _poll(self, worker: Worker) -> None:
        after = self.last_seq[worker.worker_id]
        path = f"/kv/events?after={after}&timeout={self._poll_timeout_s}"
        answer = await self._get(worker, path, self._poll_timeout_s)
        self.apply_events(worker.worker_id, answer["events"])
        if answer["events"]:
            # A busy worker emits events every step: collect them in batches rather than
            # costing it (and the router) one HTTP round trip per step. Speculative
            # entries cover the delay.
            await asyncio.sleep(self._batch_s)
