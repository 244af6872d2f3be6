"""The values a routing policy reads and returns, shared by the router and the simulator."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

# Takes back what a policy recorded when it made a decision (given the time now).
TakeBack = Callable[[float], None]


def all_of(take_backs: Sequence[TakeBack | None]) -> TakeBack | None:
    """One take-back for several records (a pair's two workers); None if there is none."""
    present = [t for t in take_backs if t is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def take_back(now: float) -> None:
        for each in present:
            each(now)

    return take_back


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What the router itself holds on a worker at selection time.

    Load is the router's own accounting (guards taken at selection), not what the worker
    reports: it is exact for the traffic this router sends and needs no round trip.
    """

    worker_id: str
    in_flight_requests: int = 0
    in_flight_prefill_tokens: int = 0
    # Reclaimable KV blocks (free + cached) over all, as a decode worker last reported
    # them: what a pair choice needs to avoid a decode worker that has no room left.
    kv_free_fraction: float = 1.0
    # Prefill tokens other router replicas hold on the worker, as its last load report
    # said (0 with one router): work queued there that this replica's guards miss.
    others_prefill_tokens: int = 0

    @property
    def sort_key(self) -> tuple[int, int]:
        """Fewer requests first; among equals, less prefill work queued."""
        return (self.in_flight_requests, self.in_flight_prefill_tokens)


# ``WorkerLoad.sort_key`` as a C-level getter, for loops over every worker on the request
# path: the property is one Python call per worker.
sort_key_of = attrgetter("in_flight_requests", "in_flight_prefill_tokens")


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt as a worker's prefix cache sees it: its length in tokens and the hashes
    of its full blocks before the last token (the last token is always computed)."""

    num_tokens: int
    reusable_hashes: Sequence[int]
    block_size: int


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """The parts of a request that policies look at.

    ``text`` is the prompt as the router sees it (no tokenizer: characters), ``pool`` and
    ``model`` select the policy state so that one pool's history never steers another's.
    ``body`` is the request itself, which the router hashes into ``blocks`` for the
    policies that read them (kv_aware); the simulator fills ``blocks`` from its trace.
    ``blocks`` is None without a tokenizer, before a worker told the block size, or for
    a body the worker would refuse.
    """

    text: str
    model: str = ""
    pool: str = "regular"
    session_key: str | None = None
    prefill_tokens: int = 0
    body: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    blocks: PromptBlocks | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Which worker and why: shown to clients in ``x-kvserve-decision`` and counted."""

    worker_id: str
    policy: str
    reason: str
    matched_fraction: float = 0.0
    # What the policy recorded for this choice (speculative blocks, a queued prefill, a
    # tree insert), for ``Policy.undo`` should the attempt fail; None: nothing recorded.
    take_back: TakeBack | None = field(default=None, compare=False, repr=False)

    def uncached_tokens(self, prompt_tokens: int) -> int:
        """The part of a ``prompt_tokens`` prompt the worker is predicted to compute."""
        return round(prompt_tokens * (1.0 - self.matched_fraction))

    def header_value(self) -> str:
        return f"policy={self.policy}; reason={self.reason}; matched={self.matched_fraction:.3f}"


@dataclass(frozen=True, slots=True)
class PairDecision(RoutingDecision):
    """A prefill/decode pair: the decode worker answers, the prefill worker (None: the
    decode worker prefills locally) computes the prompt's KV. ``matched_fraction`` is
    the prompt's part predicted cached where it is prefilled."""

    prefill_worker_id: str | None = None

    def header_value(self) -> str:
        return f"{RoutingDecision.header_value(self)}; prefill={self.prefill_worker_id or 'local'}"
