"""Prefill/decode disaggregation decisions: whether to disaggregate, and which pair.

**Conditional disaggregation.** Sending a prompt to a prefill worker costs a transfer and
a round trip; it pays off only when there is much to compute. A decode worker that
already holds most of the prompt, or a prompt whose uncached part is short, is
prefilled where it will be decoded. The decode worker applies the rule exactly (its own
cache, in tokens); the router applies the same rule to its approximate view to predict
where the prefill work will land.

**Pair choice.** The two workers are chosen together, each from its own pool's state:
decode first (it holds the request for its whole life: room in its KV pool and its
running requests matter; a prefix it already holds can make the prefill local), then,
unless the prefill is predicted local, the prefill worker with the least predicted
prefill time: the prefill tokens already queued on it plus this prompt's part that its
cache does not hold. Ties go to fewer in-flight requests, then rotate. This is the
``cache_aware`` policy's pair rule; every policy has its own
(:meth:`kvserve.core.routing.policy.Policy.select_pair`), built from the helpers here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvserve.core.routing.tie_breaking import Rotation
from kvserve.core.routing.types import WorkerLoad

PREFILL_POOL = "prefill"
DECODE_POOL = "decode"
# A decode worker with less than this fraction of its KV blocks reclaimable is avoided.
MIN_DECODE_FREE_FRACTION = 0.05


@dataclass(frozen=True, slots=True)
class PDConfig:
    # Below this many uncached prompt tokens the decode worker prefills locally.
    min_remote_prefill_tokens: int = 64
    # At or above this fraction of the prompt already cached on the decode worker, too.
    local_hit_fraction: float = 0.8

    def __post_init__(self) -> None:
        if self.min_remote_prefill_tokens < 0:
            raise ValueError("min_remote_prefill_tokens must be >= 0")
        if not 0.0 <= self.local_hit_fraction <= 1.0:
            raise ValueError("local_hit_fraction must be in [0, 1]")


def prefill_remotely(prompt_tokens: int, decode_cached_tokens: int, config: PDConfig) -> bool:
    """Whether a prompt is worth a prefill worker, given what the decode worker holds."""
    uncached = prompt_tokens - decode_cached_tokens
    if uncached < config.min_remote_prefill_tokens:
        return False
    return decode_cached_tokens < config.local_hit_fraction * prompt_tokens


def local_prefill_reason(
    prompt_tokens: int, decode_cached_tokens: int, has_prefill_workers: bool, config: PDConfig
) -> str | None:
    """Why the decode worker prefills the prompt itself (None: a prefill worker should):
    ``local_short``, ``local_cached`` or ``no_prefill_worker``."""
    if not prefill_remotely(prompt_tokens, decode_cached_tokens, config):
        short = prompt_tokens - decode_cached_tokens < config.min_remote_prefill_tokens
        return "local_short" if short else "local_cached"
    return None if has_prefill_workers else "no_prefill_worker"


def with_room(
    decodes: Sequence[WorkerLoad], min_free_fraction: float = MIN_DECODE_FREE_FRACTION
) -> Sequence[WorkerLoad]:
    """The decode workers with KV room left, or all of them when none has."""
    roomy = [w for w in decodes if w.kv_free_fraction >= min_free_fraction]
    return roomy or decodes


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    load: WorkerLoad
    free_fraction: float = 1.0  # free blocks / total blocks, as the worker last reported
    matched_fraction: float = 0.0  # of the prompt, in the decode pool's index


@dataclass(frozen=True, slots=True)
class PairChoice:
    decode: DecodeCandidate
    prefill: WorkerLoad | None  # None: the decode worker is predicted to prefill locally
    prefill_matched_fraction: float
    reason: str  # "remote" | "local_cached" | "local_short" | "no_prefill_worker"


def select_decode(
    decodes: Sequence[DecodeCandidate], min_free_fraction: float, rotation: Rotation
) -> DecodeCandidate:
    """Workers with room first; then fewer running requests; then a deeper cached prefix;
    then more free blocks; exact ties rotate."""

    def key(candidate: DecodeCandidate) -> tuple[bool, int, float, float]:
        return (
            candidate.free_fraction < min_free_fraction,
            candidate.load.in_flight_requests,
            -candidate.matched_fraction,
            -candidate.free_fraction,
        )

    best = min(key(c) for c in decodes)
    tied = [c for c in decodes if key(c) == best]
    chosen = rotation.pick([c.load for c in tied])
    return next(c for c in tied if c.load is chosen)


def select_prefill(
    prefills: Sequence[WorkerLoad], matched_fraction: Mapping[str, float], prompt_tokens: int
) -> WorkerLoad:
    """Least predicted prefill time: queued prefill tokens + this prompt's uncached part."""

    def key(worker: WorkerLoad) -> tuple[float, int]:
        uncached = prompt_tokens * (1.0 - matched_fraction.get(worker.worker_id, 0.0))
        return (worker.in_flight_prefill_tokens + uncached, worker.in_flight_requests)

    return min(prefills, key=key)


def select_pair_from_matches(
    decodes: Sequence[DecodeCandidate],
    prefills: Sequence[WorkerLoad],
    prefill_matched_fraction: Mapping[str, float],
    prompt_tokens: int,
    config: PDConfig,
    rotation: Rotation,
    min_free_fraction: float = MIN_DECODE_FREE_FRACTION,
) -> PairChoice:
    """``decodes`` must be non-empty; ``prefills`` may be empty (then all is local)."""
    decode = select_decode(decodes, min_free_fraction, rotation)
    cached = round(decode.matched_fraction * prompt_tokens)
    local = local_prefill_reason(prompt_tokens, cached, bool(prefills), config)
    if local is not None:
        return PairChoice(decode, None, 0.0, local)
    prefill = select_prefill(prefills, prefill_matched_fraction, prompt_tokens)
    return PairChoice(
        decode, prefill, prefill_matched_fraction.get(prefill.worker_id, 0.0), "remote"
    )
