"""The decode worker's half of prefill/decode disaggregation: reserve, install, hand over.

A reservation (:meth:`PDImporter.reserve`) matches the prompt in this worker's cache
(pinned) and allocates the rest of its full blocks under a lease id. The blocks are
owned by the lease, not in the prefix tree, so nothing can read them before they are
installed; each received run is written, then committed (:meth:`PDImporter.install`).
Handing over is an ordinary request of the lease's id: the scheduler tells the connector
it was added, the lease's deadline ends, and the request matches every installed block,
computes only the tail (the tokens after the last full block, whose logits it needs),
and decodes. The lease keeps its pins until the request is admitted, so no eviction can
take the blocks in between; a lease that lapses (sender dead or stalled) gives its
blocks back.

A lease is taken only if the blocks left afterwards (free or evictable) still let every
running sequence grow to its longest possible length (prompt + ``max_tokens``): leased
blocks cannot be preempted, so a lease that ate that room would have the scheduler
preempt running decodes instead. Without the room the prompt is prefilled here, queued
by the scheduler like any request, which admits it only when there is room.

Every method runs on the engine's own thread (the worker sends them as commands).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.core.hashing import block_hashes, salted
from kvserve.core.kv_lease import LeaseTable, blocks_to_finish, lease_fits
from kvserve.core.request import Request, RequestStatus
from kvserve.core.routing.pd_pair import PDConfig, prefill_remotely
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.kv_block_io import write_blocks
from kvserve.engine.kv_connector import ConnectorContext, ConnectorFactory, KVConnector

DEFAULT_LEASE_TTL_S = 30.0


class LeaseLost(RuntimeError):
    """Blocks arrived for a reservation that expired or was released."""


@dataclass(frozen=True, slots=True)
class Reservation:
    token_ids: list[int]
    num_blocks: int  # full blocks before the prompt's last token: what a transfer fills
    num_cached_blocks: int  # of those, already in this worker's cache
    remote: bool  # False: prefill here (conditional disaggregation); nothing is held


@dataclass(slots=True)
class _Reserved:
    hashes: list[int]
    next_block: int
    token_ids: list[int]  # the prompt's, for the stored events
    max_num_tokens: int  # the longest the sequence may get: prompt + its max tokens
    request: Request | None = None  # the request that took the blocks over


def _lease_key(lease_id: str) -> str:
    """The lease's blocks sit in the KV cache manager beside the request of the same id."""
    return f"lease:{lease_id}"


def pd_importer(
    pd_config: PDConfig | None = None, lease_ttl_s: float = DEFAULT_LEASE_TTL_S
) -> ConnectorFactory:
    """The factory a decode worker's engine builds its importer with."""
    return lambda context: PDImporter(context, pd_config or PDConfig(), lease_ttl_s)


class PDImporter(KVConnector):
    def __init__(self, context: ConnectorContext, pd_config: PDConfig, lease_ttl_s: float) -> None:
        self._pool, self.layout = context.require_pool("PD transfers")
        self._cache = context.kv_cache
        self._namespace = context.namespace
        self._max_model_len = context.max_model_len
        self.pd_config = pd_config
        self.lease_ttl_s = lease_ttl_s
        self.leases = LeaseTable()
        self._reserved: dict[str, _Reserved] = {}
        self._requests: dict[str, Request] = {}  # every request in the engine, by id

    @property
    def num_reservations(self) -> int:
        return len(self._reserved)

    @property
    def max_transfer_blocks(self) -> int:
        """The most blocks one transfer can land: a prompt shorter than the model's
        length, in a pool of this size."""
        cache = self._cache
        return min(-(-self._max_model_len // cache.block_size), cache.num_blocks)

    def reserve(
        self,
        lease_id: str,
        token_ids: list[int],
        now: float,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
    ) -> Reservation:
        """Match the prompt here and, if a prefill worker should compute the rest, hold
        blocks for it under a lease. ``max_tokens`` (None: up to the context length) is
        the request's, for the room its sequence will grow into. Raises
        :class:`InvalidRequestError` on a prompt that leaves no room to generate."""
        if len(token_ids) >= self._max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(token_ids)} tokens; the context holds "
                f"{self._max_model_len} and at least one must be generated",
            )  # fmt: skip
        cache = self._cache
        block_size = cache.block_size
        num_blocks = (len(token_ids) - 1) // block_size
        namespace = salted(self._namespace, cache_salt)  # as the request's own chain
        hashes = block_hashes(token_ids[: num_blocks * block_size], block_size, namespace)
        key = _lease_key(lease_id)
        room = self._max_model_len - len(token_ids)
        max_num_tokens = len(token_ids) + (room if max_tokens is None else min(max_tokens, room))
        cached = cache.match_prefix(key, hashes)
        remote = prefill_remotely(len(token_ids), cached * block_size, self.pd_config)
        remote = remote and lease_fits(
            cache.num_available_blocks,
            num_blocks - cached,
            blocks_to_finish(max_num_tokens, num_blocks, block_size),
            self.growth_blocks(),
        )
        if not (remote and cache.allocate_slots(key, num_blocks * block_size)):
            cache.free_request(key)  # prefill here; the scheduler queues it
            return Reservation(token_ids, num_blocks, cached, remote=False)
        self.leases.grant(lease_id, now, self.lease_ttl_s)
        self._reserved[lease_id] = _Reserved(hashes, cached, token_ids, max_num_tokens)
        return Reservation(token_ids, num_blocks, cached, remote=True)

    def growth_blocks(self) -> int:
        """Blocks every sequence here may still allocate, each up to its longest possible
        length: running and waiting requests (a waiting one holds nothing yet, or its
        lease's blocks) and leases whose request has not come yet."""
        cache = self._cache
        size = cache.block_size
        growth = 0
        for request in self._requests.values():
            if request.status is RequestStatus.FINISHED:
                continue
            held = cache.num_request_blocks(request.request_id)
            if request.request_id in self._reserved:  # still pinned by its lease too
                held = max(held, cache.num_request_blocks(_lease_key(request.request_id)))
            growth += blocks_to_finish(request.max_num_tokens, held, size)
        for lease_id, reserved in self._reserved.items():
            if reserved.request is None:
                leased = cache.num_request_blocks(_lease_key(lease_id))
                growth += blocks_to_finish(reserved.max_num_tokens, leased, size)
        return growth

    def install(self, lease_id: str, first_block: int, blocks: torch.Tensor, now: float) -> None:
        """Write a run of received blocks into the lease's blocks, then commit them."""
        reserved = self._reserved.get(lease_id)
        if reserved is None or reserved.request is not None or not self.leases.renew(lease_id, now):
            raise LeaseLost(f"no live reservation {lease_id!r}")
        end = first_block + blocks.shape[0]
        if first_block != reserved.next_block or end > len(reserved.hashes):
            raise ValueError(
                f"blocks [{first_block}, {end}) do not continue [0, {reserved.next_block}) "
                f"of {len(reserved.hashes)}"
            )
        key = _lease_key(lease_id)
        table = self._cache.block_table(key)[first_block:end]
        write_blocks(self._pool, self.layout, table, blocks)
        self._cache.commit_blocks(key, reserved.hashes[:end], reserved.token_ids)
        reserved.next_block = end

    def release(self, lease_id: str) -> None:
        """Give back what the lease holds; blocks already installed stay cached."""
        self.leases.release(lease_id)
        if self._reserved.pop(lease_id, None) is not None:
            self._cache.free_request(_lease_key(lease_id))

    def expire(self, now: float) -> int:
        """Free the blocks of every lapsed lease; returns how many lapsed."""
        lapsed = self.leases.expire(now)
        for lease in lapsed:
            self.release(lease.lease_id)
        return len(lapsed)

    # -- connector hooks ---------------------------------------------------------------

    def request_added(self, request: Request) -> None:
        """A request with the id of a reservation takes its blocks over."""
        self._requests[request.request_id] = request
        reserved = self._reserved.get(request.request_id)
        if reserved is not None:
            self.leases.release(request.request_id)  # no deadline once handed over
            reserved.request = request

    def after_step(self, plan: SchedulerOutput) -> list[str]:
        """A handed-over request pins its blocks once admitted: the lease can let go."""
        for lease_id, reserved in list(self._reserved.items()):
            request = reserved.request
            if request is not None and request.status is not RequestStatus.WAITING:
                self.release(lease_id)
        return []

    def request_finished(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        reserved = self._reserved.get(request.request_id)
        if reserved is not None and reserved.request is request:
            self.release(request.request_id)
