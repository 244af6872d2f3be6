"""Prefill/decode disaggregation in the simulator: the decode worker's reservation and the
transfer's time.

The decode worker decides as the real one does (:class:`kvserve.engine.pd_import.PDImporter`,
whose tensor side the simulator has no use for): it pins what its cache holds of the
prompt's full blocks before the last token, applies the conditional rule exactly
(:func:`kvserve.core.routing.pd_pair.prefill_remotely`) and refuses a lease unless every
sequence it holds and the leased one can all reach full length
(:func:`kvserve.core.kv_lease.lease_fits`); otherwise it allocates the remaining blocks
under ``lease:<request id>``. The blocks are committed (installed) when the transfer
ends and the lease is let go once the request is admitted and pins them itself.

A transfer takes ``latency_s`` plus its bytes over ``gbps``. Its bytes are the blocks
the decode worker did not hold, at the cost profile's KV bytes per token. It starts
when the prefill worker's request ends (the real export streams each step's blocks
while later chunks compute, so this is the pessimistic end of the range).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_lease import blocks_to_finish, lease_fits
from kvserve.core.request import Request, RequestStatus
from kvserve.core.routing.pd_pair import PDConfig, prefill_remotely
from kvserve.core.sampling_params import SamplingParams


def lease_key(request_id: str) -> str:
    """The lease's blocks sit in the cache beside the request of the same id."""
    return f"lease:{request_id}"


@dataclass(frozen=True, slots=True)
class Reservation:
    remote: bool
    num_blocks: int  # full blocks before the prompt's last token
    cached_blocks: int  # of those, what the decode worker holds already


def growth_blocks(cache: KVCacheManager, sequences: Iterable[Request]) -> int:
    """Blocks ``sequences`` (queued or leased, on the decode worker of ``cache``) may still
    allocate, each up to its longest length; a leased one holds its lease's blocks."""
    size = cache.block_size
    return sum(
        blocks_to_finish(
            r.max_num_tokens,
            max(
                cache.num_request_blocks(r.request_id),
                cache.num_request_blocks(lease_key(r.request_id)),
            ),
            size,
        )
        for r in sequences
        if r.status is not RequestStatus.FINISHED
    )


def reserve(
    cache: KVCacheManager, request: Request, others_growth: int, config: PDConfig
) -> Reservation:
    """Match ``request``'s prompt in the decode worker's ``cache`` and, if a prefill worker
    should compute the rest, hold the blocks for it under a lease; ``others_growth`` is
    :func:`growth_blocks` of everything else the decode worker holds."""
    hashes = request.reusable_block_hashes()
    key = lease_key(request.request_id)
    cached = cache.match_prefix(key, hashes)
    size = cache.block_size
    remote = prefill_remotely(request.num_prompt_tokens, cached * size, config) and lease_fits(
        cache.num_available_blocks,
        len(hashes) - cached,
        blocks_to_finish(request.max_num_tokens, len(hashes), size),
        others_growth,
    )
    if not (remote and cache.allocate_slots(key, len(hashes) * size)):
        cache.free_request(key)
        return Reservation(False, len(hashes), cached)
    return Reservation(True, len(hashes), cached)


def install(cache: KVCacheManager, request: Request) -> None:
    """The transfer ended: the leased blocks now hold the prompt's K/V (committed)."""
    hashes = request.reusable_block_hashes()
    cache.commit_blocks(lease_key(request.request_id), hashes, request.token_ids)


def release(cache: KVCacheManager, request: Request) -> None:
    """Give back what the lease pins; committed blocks stay cached."""
    cache.free_request(lease_key(request.request_id))


@dataclass(frozen=True, slots=True)
class TransferModel:
    gbps: float  # gigabytes per second
    latency_s: float
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        if self.gbps <= 0 or self.latency_s < 0 or self.kv_bytes_per_token < 0:
            raise ValueError("transfer: gbps must be > 0, latency and bytes per token >= 0")

    def seconds(self, num_tokens: int) -> float:
        return self.latency_s + num_tokens * self.kv_bytes_per_token / (self.gbps * 1e9)


def prefill_request(
    request: Request, reservation: Reservation, namespace: bytes, block_size: int
) -> Request:
    """What the prefill worker runs: an ordinary request over the prompt's full blocks
    plus one token, so that it uses and fills its own prefix cache, ending at its first
    token."""
    tokens = request.token_ids[: reservation.num_blocks * block_size + 1]
    return Request(
        f"{request.request_id}/prefill",
        tokens,
        SamplingParams(max_tokens=1),
        max_tokens=1,
        namespace=namespace,
        block_size=block_size,
    )
