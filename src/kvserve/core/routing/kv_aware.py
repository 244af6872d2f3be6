"""Exact KV-aware routing: send each request where its first token comes soonest.

One cost in seconds instead of a hard cache/load switch. For each candidate worker::

    predicted TTFT = queued prefill time
                   + this request's uncached tokens × prefill_token_s
                   + tokens found in host memory × host_load_token_s
                   + tokens found in storage × storage_load_token_s
                   + in-flight requests × decode_request_s
                   + prefill other router replicas queued there (as the worker reported)

The queued prefill time is the smaller of two views of the same work: the router's load
guards (prompt tokens of requests that have no first token yet: exact about *when* the
work ends, blind to what was cached) and the policy's own prediction (each routed
request's *uncached* tokens, queued behind the worker's earlier ones: exact about how
much work, blind to an early end). Either alone misleads: counting cached tokens as work
makes the holder of a prefix look busy and scatters its conversations.

Device hits are free; host and storage hits cost their transfer time; the rest must be
computed behind whatever prefill the worker already has queued.

The choice is not this request's TTFT alone. Sending a request anywhere but to the
deepest holder of its prefix recomputes what the holder has cached: GPU time the fleet
spends again, which every request queued behind it on that worker waits for, and blocks
it writes there that evict someone else's. Each candidate is scored::

    score = predicted TTFT + recompute_weight × (prefill seconds here
                                                 − prefill seconds on the deepest holder)

and the smallest score wins. A holder keeps a request until its queue exceeds the
recompute (1 + recompute_weight) times over; past that the prefix is worth replicating
on a second worker, and it spreads. With a weight of 0 the score is the TTFT: kv_aware
moves a conversation off a busy holder as soon as a cold worker is faster for the
request at hand, and gives up hit rate to cache_aware, more with load (the Mooncake
conversation trace, 10 workers: 0.335 against 0.360 at the trace's rate, 0.303 against
0.359 at ×4).

A weight alone piles requests onto holders that cannot serve them as predicted: on agent
sessions of 20–50k tokens with 200k-token caches, weight 8 made mean TTFT 12× cache_aware's
at ×2 arrivals, its worst requests predicted 1–2 s and waiting 40 s for room beside the
holder's running sequences. So the weight a decision applies is discounted by the
deepest holder's pressure (:mod:`kvserve.core.routing.future_cost`): the chance it keeps
the prefix through its predicted wait (its cache's retention time, from the eviction
rate its KV events show) times the share of the prompt that fits beside the prompts in
flight there. A holder with room keeps the full weight; one under pressure none.
Measured with ``kvserve simulate`` on the conversation, agent-session and
bursty-system-prompt traces at ×1, ×2 and ×4 (docs/benchmarks.md, "Future cost under
cache pressure"): weight 8 with that discount keeps cache_aware's hit rate (within 0.01)
at a lower mean TTFT than cache_aware's on all nine, but has a higher TTFT than weight 0
on the bursty prompts (mean 2–2.7×) and the agent sessions at ×4 (1.3×).

A choice also moves a prefix's home: the requests that extend a prompt (a conversation's
next turns) follow its blocks to the worker that computed them. In a fleet with idle
workers, TTFT alone starts new conversations on a busy holder of their first blocks (a
shared system prompt saves a few milliseconds of prefill there) rather than on an idle
worker, and their later turns then queue there: on the Mooncake conversation trace at
160 workers ×16, half the fleet stayed idle and 95 % of requests went to a worker already
busy (cache_aware: 27 %), so kv_aware computed more (hit rate 0.343 against 0.366) and
waited longer (TTFT p50 0.114 against 0.105 s). ``home_weight`` (h) charges each
candidate for the load its later requests will meet::

    score += h × (TTFT − prefill seconds there) × (tokens computed there / prompt tokens)

so a worker that would compute most of the prompt counts its wait (1 + h) times, and its
own holder (computing a few new tokens) about once. With it, the recompute weight is
scaled by the deepest holder's share of the prompt: a holder of a shared system prompt
alone is a weak reason to queue, a holder of the conversation so far a strong one. At 160
workers, h = 3 with a recompute weight of 8 gives hit rate 0.367, TTFT p50 0.102 s and
p99 4.95 s against cache_aware's 0.366, 0.105 and 5.91 (docs/benchmarks.md, "A prefix's
home"); at 10 workers it keeps fewer hits under load than the unscaled weight.

Both weights trade this request's TTFT for later ones, which pays while the fleet has
room to spare: an idle worker to make a new home of, a holder whose queue a kept request
does not lengthen much. In a fleet already queueing, they keep requests on holders that
cannot serve them soon (agent sessions at ×4 on 10 workers: mean TTFT 2.30 s with h 3
and weight 8 on every decision against 1.35 s by TTFT alone). So each applies only while
the fleet has slack for it: while the mean worker's guarded prefill (:func:`~kvserve.core.
routing.pool_loads.guarded_prefill_tokens`, as prefill seconds) is at most
``home_slack_queue_s`` (0.4 s) for the home weight, ``recompute_slack_queue_s`` (10 s) for
the recompute weight; past both, a decision ranks by TTFT alone. The home weight counts a
wait several times, so it goes first; the recompute weight adds a constant per
candidate, and it is what keeps a conversation's hits on a queueing fleet (the
conversation trace ×4: hit rate 0.304 with one 0.4 s gate for both, 0.352 with these),
stopping only once the fleet is saturated. Measured (docs/benchmarks.md, "A slack bound
per weight"): the defaults, h 3, weight 9, 0.4 s and 10 s, keep cache_aware's hit rate
(within 0.01) at a lower mean TTFT on every cell of the conversation, agent-session and
bursty-prompt traces at ×1, ×2 and ×4 on 10 workers, and at 160 workers. A gate on the
share of idle workers did not hold: the weights themselves idle workers by piling
requests onto holders, which held it open.

Ties (equal predictions) go to the less loaded worker, then by rendezvous hashing on the
request's block chain rather than a per-process rotation: two router replicas with the
same index and loads make the same choice. That is what piles a burst onto one worker
when it reaches several replicas at one instant, before any hears the others'
announcements; so in a burst replicas of several (``as_replica``) take turns by rank
(:meth:`KvAwareRouting.decision_delay`), each choosing after the lower ranks' choices
were announced. A replica may also add its own fixed offset per worker, below
``replica_spread_s`` (0 by default since the turns), to every score
(:class:`ReplicaSalt`): near-equal choices then differ by replica, and it predicts a few
more of the lightest loads (``SALTED_LOAD_ROUNDS``) for the offset to choose among. A
lone router does neither.

After a choice the request's blocks are inserted speculatively on the chosen worker
(see :mod:`kvserve.core.routing.kv_index`), so the next request of a burst sharing a new
prefix follows the first before any event confirms it. Both records of a choice (the
speculation and the queued prefill) come with a take-back, which the router calls when
the attempt fails before its first token: a worker that never computed the prompt is
then neither predicted to hold it nor to be busy computing it.

A decision predicts only a few workers, whatever the fleet's size: the holders of a
prefix of the prompt (one walk of the index yields them as one mask per depth; of each
group sharing a match, only its lightest) and the workers whose load term is the
smallest (:mod:`kvserve.core.routing.load_order`, kept up to date by ``observe_load`` as
guards change). Any other worker holds nothing of the prompt, or the same as a lighter
holder, and has a larger load term, so it cannot predict a smaller TTFT: the smallest
prediction is :func:`lowest_ttft`'s over the whole fleet. What differs is the choice
among equal predictions (a tie of TTFT and load): it is made among the candidates, not
the whole fleet. A fleet of up to ``SMALL_FLEET`` workers is predicted whole (the
reference rule, cheaper there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Any, NamedTuple

import xxhash

from kvserve.core.cost_model import CostModel
from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.arrival_bursts import ArrivalBursts
from kvserve.core.routing.future_cost import FutureCost, HolderPressure
from kvserve.core.routing.kv_index import TIERS, KVBlockIndex, WorkerMatch
from kvserve.core.routing.load_order import LoadOrder, load_term
from kvserve.core.routing.pool_loads import PoolLoads, guarded_prefill_tokens, loads_by_id
from kvserve.core.routing.tie_breaking import ReplicaSalt
from kvserve.core.routing.types import TakeBack, WorkerLoad, sort_key_of

_NO_MATCH = WorkerMatch({})
# With a replica's salt: walks of the load orders for candidates (each adds up to three)
SALTED_LOAD_ROUNDS = 4
# Fleets of up to this many workers are predicted whole (the reference rule): finding
# the few worth predicting costs more than predicting them all there (routing_scale.py:
# at 100 workers whole 3.2x cache_aware's decision time against 4.4-5.0x for the few, at
# 250 4.7x against 3.2x)
SMALL_FLEET = 128
# With a replica's salt and a recompute or home weight, a fleet's workers are scored one
# by one (no grouped choice), and finding the few worth predicting costs less past this
# many (instructions per decision, routing_scale.py's fleet, 16-block prompts, weight 8
# and home weight 3, measured when every weighted decision took that path: 20 workers
# 669k whole against 711k for the few, 30 workers 839k against 734k, 100 workers 2.20M
# against 0.72M)
SMALL_WEIGHTED_FLEET = 24
# With a replica's salt and no weight, the same crossover lies further out: salted
# candidates walk the load orders SALTED_LOAD_ROUNDS times (instructions per decision,
# same fleet and prompts: 40 workers 798k whole against 1,011k for the few, 50 workers
# 927k against 875k, 100 workers 1,537k against 923k)
SMALL_SALTED_FLEET = 48
# Holders sharing one match: up to this many are listed and scanned; more are searched
# in LoadOrder's arrays (a fixed cost of a few array operations, cheaper past this)
GROUP_SCAN = 16


class _Either:
    """In either of two containers (no copy of either)."""

    def __init__(self, first: Container[str], second: Container[str]) -> None:
        self._first, self._second = first, second

    def __contains__(self, item: object) -> bool:
        return item in self._first or item in self._second


@dataclass(frozen=True, slots=True)
class KvAwareConfig:
    """Defaults are the ``llama3-8b-h100`` cost profile's (:mod:`kvserve.core.cost_model`).

    Computing ``n`` tokens after ``c`` cached ones takes
    ``n × prefill_token_s + attention_pair_s × n × (c + (n + 1) / 2)``: the linear part
    is the matmuls, the quadratic one causal attention, which dominates long prompts.
    Host loads cross PCIe Gen5 (128 KiB of KV per token at ~50 GB/s ≈ 2.6 µs); storage
    loads cross a 100 Gb/s network (≈ 10 µs). ``decode_request_s`` is what one running
    sequence adds to the steps a new prefill shares with it: 5 ms, measured with
    ``kvserve simulate`` on the Mooncake conversation trace (at 160 workers ×16, 2 ms
    gave hit rate 0.334, TTFT p50 0.124 s, p99 4.97 s; 5 ms 0.346, 0.111, 4.93; 10 ms
    0.347, 0.110, 4.88; at 10 workers ×1, 2 ms and 5 ms differ by under 1 %): a smaller
    weight lets hits pile onto a holder whose batch slows every step.
    """

    prefill_token_s: float = 25.35e-6
    attention_pair_s: float = 1.06e-9
    host_load_token_s: float = 2.6e-6
    storage_load_token_s: float = 10e-6
    decode_request_s: float = 5e-3
    speculative_ttl_s: float = 2.0
    # Seconds of score per second of prefill a choice computes beyond what the deepest
    # holder would: what the recompute costs the requests queued behind it, discounted
    # by the holder's pressure (see the module docstring), applied while the fleet has
    # slack (``recompute_slack_queue_s``). 0 ranks by this request's TTFT.
    recompute_weight: float = 9.0
    # The weight is discounted by the deepest holder's chance of still holding the prefix
    # when the request runs there, from its cache's eviction rate averaged over
    # ``retention_window_s`` (see :mod:`kvserve.core.routing.future_cost`); margin 0: no
    # discount.
    retention_margin: float = 1.0
    retention_window_s: float = 60.0
    # (block, holder) entries the index keeps; None: unbounded (see KVBlockIndex)
    index_max_entries: int | None = None
    # With router replicas only: each adds its own fixed offset in [0, this) per worker
    # to the scores, so that near-equal choices differ across replicas (see
    # :class:`~kvserve.core.routing.tie_breaking.ReplicaSalt`). 0 (the default since the
    # stagger below, by measurement: docs/benchmarks.md "Replicas that take turns in a
    # burst"; 0.05 before), for replicas that cannot take turns. One router: unused.
    replica_spread_s: float = 0.0
    # ... and only while requests arrive in bursts: at least half of the last gaps
    # between those the replica knows of (its own, its peers' announced) under this many
    # seconds (see :class:`~kvserve.core.routing.arrival_bursts.ArrivalBursts`; 0: every
    # decision salted). A few loopback announcement delays: a peer's choice made further
    # apart has been heard.
    replica_burst_window_s: float = 0.002
    # With router replicas only, while requests arrive in bursts: the replica ranked r
    # among its peers (0, 1, ...) decides r times this many seconds after a request
    # arrives, so that its peers' choices made in the same burst have been announced to
    # it (see :meth:`KvAwareRouting.decision_delay`). Above the announcement delay; 0: every
    # replica decides at once, blind to its peers' share of a burst.
    replica_stagger_s: float = 0.001
    # Seconds of score per second of a candidate's load, times the share of the prompt it
    # would compute: a choice that computes most of a prompt makes the worker that prefix's
    # home, where the requests extending it (a conversation's next turns) follow and meet
    # the same load (see the module docstring). With it, the recompute weight is also
    # scaled by the deepest holder's share of the prompt. 0: neither.
    home_weight: float = 3.0
    # Each weight applies only while the fleet has slack: while the mean worker's guarded
    # prefill (this router's guards and its peers' reports, in prefill seconds) is at most
    # this many seconds, for the home weight, and the next for the recompute weight. Past
    # both, a decision ranks by TTFT alone. The home weight counts a candidate's wait
    # several times, so it goes first: a fleet that busy has no idle worker to make a home
    # of. The recompute weight adds a constant per candidate, which keeps a holder's hits
    # through a queueing fleet and stops only where the whole fleet is saturated and
    # holders cannot serve their requests soon (see the module docstring). ``inf``: always.
    home_slack_queue_s: float = 0.4
    recompute_slack_queue_s: float = 10.0

    def __post_init__(self) -> None:
        values = (
            self.prefill_token_s,
            self.attention_pair_s,
            self.host_load_token_s,
            self.storage_load_token_s,
            self.decode_request_s,
        )
        if any(v < 0 for v in values) or self.prefill_token_s == 0:
            raise ValueError("kv_aware costs must be >= 0 and prefill_token_s > 0")
        if self.speculative_ttl_s < 0:
            raise ValueError("speculative_ttl_s must be >= 0")
        if self.recompute_weight < 0:
            raise ValueError("recompute_weight must be >= 0")
        if self.replica_spread_s < 0:
            raise ValueError("replica_spread_s must be >= 0")
        if self.replica_burst_window_s < 0:
            raise ValueError("replica_burst_window_s must be >= 0")
        if self.replica_stagger_s < 0:
            raise ValueError("replica_stagger_s must be >= 0")
        if self.home_weight < 0:
            raise ValueError("home_weight must be >= 0")
        if not self.home_slack_queue_s >= 0:
            raise ValueError("home_slack_queue_s must be >= 0")
        if not self.recompute_slack_queue_s >= 0:
            raise ValueError("recompute_slack_queue_s must be >= 0")
        HolderPressure(self.retention_margin, self.retention_window_s)  # validates

    @classmethod
    def from_cost_model(cls, cost: CostModel, **overrides: Any) -> KvAwareConfig:
        """The prefill terms of a GPU cost profile (the simulator's, or a measured one)."""
        fields = {
            "prefill_token_s": cost.new_token_s + cost.context_token_s,
            "attention_pair_s": cost.attention_pair_s,
        }
        return cls(**(fields | overrides))

    def tokens_within(self, seconds: float) -> float:
        """The prompt tokens (of an empty cache) whose prefill takes ``seconds``: the
        inverse of :meth:`prefill_s`, whose cost ``a × n + b × n × (n + 1) / 2`` grows
        with ``n``."""
        a, b = self.prefill_token_s, self.attention_pair_s
        if math.isinf(seconds) or not b:
            return seconds / a
        linear = a + b / 2
        return (math.sqrt(linear * linear + 2 * b * seconds) - linear) / b

    def prefill_s(self, num_tokens: float, cached_tokens: float = 0) -> float:
        """Seconds to compute ``num_tokens`` prompt tokens after ``cached_tokens`` (a
        mean worker's may be fractional)."""
        pairs = num_tokens * (cached_tokens + (num_tokens + 1) / 2)
        return num_tokens * self.prefill_token_s + pairs * self.attention_pair_s


class Prediction(NamedTuple):
    """Tuples, this and :class:`KvAwareChoice`, not frozen dataclasses: both are made on
    every decision, and a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``."""

    worker: WorkerLoad
    cached_tokens: int  # prompt tokens it would not compute (any tier, speculation included)
    ttft_s: float


class KvAwareChoice(NamedTuple):
    prediction: Prediction
    reason: str  # "cache_hit" | "load_spread" | "cache_miss"

    @property
    def worker_id(self) -> str:
        return self.prediction.worker.worker_id


class PrefillQueue:
    """When each worker will be done with the prefills this policy sent it (predicted).

    A routed request's uncached tokens queue behind the work already there; the queue
    drains with time. The queue ends live in ``loads`` (each worker's load entry, where
    predictions read them): this is the arithmetic of adding and taking back.
    """

    def __init__(self, loads: LoadOrder) -> None:
        self._loads = loads

    def queued_s(self, worker_id: str, now: float) -> float:
        done_at = self._loads.done_at(worker_id)
        return 0.0 if done_at is None else max(0.0, done_at - now)

    def push(self, worker_id: str, seconds: float, now: float) -> float:
        """Queue ``seconds`` of prefill; returns when they are predicted to end."""
        done_at = now + self.queued_s(worker_id, now) + seconds
        self._loads.set_done(worker_id, done_at)
        return done_at

    def take_back(self, worker_id: str, seconds: float, ends_at: float, now: float) -> None:
        """A pushed prefill (``seconds`` ending at ``ends_at``) will not run after all:
        the queue ends sooner by the part of it not yet predicted done."""
        done_at = self._loads.done_at(worker_id)
        if done_at is not None:
            left = min(seconds, max(0.0, ends_at - now))
            self._loads.set_done(worker_id, max(now, done_at - left))


def predict(
    worker: WorkerLoad,
    match: WorkerMatch,
    prompt_tokens: int,
    block_size: int,
    queued_s: float,
    config: KvAwareConfig,
) -> Prediction:
    """The predicted time to first token of a ``prompt_tokens`` request on ``worker``,
    given this policy's own prediction ``queued_s`` of the prefill queued there."""
    ttft, cached = _ttft(worker, match, prompt_tokens, block_size, queued_s, config)
    return Prediction(worker, cached, ttft)


def _ttft(
    worker: WorkerLoad,
    match: WorkerMatch,
    prompt_tokens: int,
    block_size: int,
    queued_s: float,
    config: KvAwareConfig,
) -> tuple[float, int]:
    """:func:`predict`'s TTFT and cached tokens, without building a Prediction: the load
    term plus the prompt's (prefill and loading, summed first, so that workers sharing a
    match share that sum, as the whole fleet's groups add it)."""
    prefill_s, loading_s, cached = _prompt_terms(match, prompt_tokens, block_size, config)
    return _load_term(worker, queued_s, config) + (prefill_s + loading_s), cached


def _prompt_terms(
    match: WorkerMatch, prompt_tokens: int, block_size: int, config: KvAwareConfig
) -> tuple[float, float, int]:
    """The part of a worker's predicted TTFT that its match decides: seconds computing
    the uncached tokens, seconds loading host and storage hits, and the cached tokens."""
    by_tier = match.blocks_by_tier
    host_tokens = by_tier.get("host", 0) * block_size
    storage_tokens = by_tier.get("storage", 0) * block_size
    cached = min(match.num_blocks * block_size, prompt_tokens)
    loading_s = (
        host_tokens * config.host_load_token_s + storage_tokens * config.storage_load_token_s
    )
    return config.prefill_s(prompt_tokens - cached, cached), loading_s, cached


def _load_term(worker: WorkerLoad, queued_s: float, config: KvAwareConfig) -> float:
    """The part of a worker's predicted TTFT that does not depend on the prompt: the
    queued prefill, then the terms that change only with the guards, summed first (the
    expression :class:`LoadOrder` keeps, so that predictions from its terms are these
    floats bit for bit)."""
    return min(queued_s, config.prefill_s(worker.in_flight_prefill_tokens)) + (
        worker.in_flight_requests * config.decode_request_s
        + config.prefill_s(worker.others_prefill_tokens)
    )


def _rendezvous_winner(
    tied: Sequence[tuple[WorkerLoad, float, int]], tie_key: int
) -> tuple[WorkerLoad, float, int]:
    """The tied worker whose hash of ``tie_key/worker_id`` is the largest (the key's
    decimal text made once: converting a 64-bit key per tied worker was most of it)."""
    prefix = f"{tie_key}/"
    digest = xxhash.xxh3_64_intdigest
    return max(tied, key=lambda t: digest((prefix + t[0].worker_id).encode()))


def lowest_ttft(
    workers: Sequence[WorkerLoad],
    matches: Mapping[str, WorkerMatch],
    queued_s: Mapping[str, float],
    prompt_tokens: int,
    block_size: int,
    tie_key: int,
    config: KvAwareConfig,
) -> KvAwareChoice:
    """The worker (of a non-empty ``workers``) with the smallest predicted TTFT: every
    worker predicted, the reference rule that :meth:`KvAwareRouting.best` follows."""
    scored = [
        (
            w,
            *_ttft(
                w,
                matches.get(w.worker_id, _NO_MATCH),
                prompt_tokens,
                block_size,
                queued_s.get(w.worker_id, 0.0),
                config,
            ),
        )
        for w in workers
    ]
    return _choose(scored, tie_key, prompt_tokens, config)


def _deepest_holders(
    scored: Sequence[tuple[WorkerLoad, float, int]],
) -> Iterator[tuple[WorkerLoad, float]]:
    """Of (worker, TTFT, cached tokens): the (worker, TTFT) of those matched deepest, if
    any holds some of the prompt."""
    deepest = max(map(itemgetter(2), scored))
    if deepest:
        yield from ((w, ttft) for w, ttft, cached in scored if cached == deepest)


def _choose(
    scored: Sequence[tuple[WorkerLoad, float, int]],
    tie_key: int,
    prompt_tokens: int,
    config: KvAwareConfig,
    weight: float | None = None,
    salt: ReplicaSalt | None = None,
) -> KvAwareChoice:
    """Of (worker, TTFT, cached tokens): the smallest score (equal up to a nanosecond is
    a tie), then the lighter guards, then rendezvous hashing (computed for the tied only).
    The score is the TTFT plus ``weight`` (default: ``recompute_weight``, undiscounted)
    times the prefill seconds the choice computes beyond what the deepest holder would,
    plus the home term (``home_weight``), plus a router replica's ``salt`` for the
    worker, if any."""
    deepest = max(map(itemgetter(2), scored))
    weight = config.recompute_weight if weight is None else weight
    if weight or salt is not None or config.home_weight:
        ranks = _ranks(scored, deepest, prompt_tokens, config, weight, salt)
        lowest = min(ranks)
        tied = [s for s, rank in zip(scored, ranks, strict=True) if rank == lowest]
        return _chosen(tied, deepest, tie_key)
    # the score is the TTFT: only those within 2 ns of the smallest can round to it
    ttfts = list(map(itemgetter(1), scored))
    lowest_s = min(ttfts)
    near_s = lowest_s + 2e-9
    # one near the smallest (most decisions): it is the choice, nothing to rank
    # (counted and found in C: a comprehension over a whole fleet cost more)
    if sum(map(near_s.__ge__, ttfts)) == 1:
        return _chosen([scored[ttfts.index(lowest_s)]], deepest, tie_key)
    return _chosen(_lightest([s for s in scored if s[1] <= near_s]), deepest, tie_key)


def _lightest(
    near: Sequence[tuple[WorkerLoad, float, int]],
) -> list[tuple[WorkerLoad, float, int]]:
    """Of (worker, TTFT, cached tokens) near the smallest TTFT: those tied in (TTFT
    rounded to the nanosecond, the guards' sort key). Where they share one TTFT (idle
    workers holding the same, say), by the sort key alone: a rounding and a property
    call per worker made a tie among 30 idle workers cost as much as the decision."""
    keys = list(map(sort_key_of, map(itemgetter(0), near)))
    ttfts = list(map(itemgetter(1), near))
    if min(ttfts) == max(ttfts):
        lowest_key = min(keys)
        return [s for s, key in zip(near, keys, strict=True) if key == lowest_key]
    ranks = [(round(ttft, 9), key) for ttft, key in zip(ttfts, keys, strict=True)]
    lowest = min(ranks)
    return [s for s, rank in zip(near, ranks, strict=True) if rank == lowest]


def _chosen(
    tied: Sequence[tuple[WorkerLoad, float, int]], deepest: int, tie_key: int
) -> KvAwareChoice:
    """The choice among ``tied`` (by rendezvous hashing, computed only for a real tie),
    and why, given the ``deepest`` match of any worker scored."""
    worker, ttft, cached = tied[0] if len(tied) == 1 else _rendezvous_winner(tied, tie_key)
    if deepest == 0:
        reason = "cache_miss"
    elif cached == deepest:
        reason = "cache_hit"
    else:
        reason = "load_spread"
    return KvAwareChoice(Prediction(worker, cached, ttft), reason)


class _WholeFleet(NamedTuple):
    """A small fleet's scores as :meth:`KvAwareRouting._whole_fleet` groups them. The
    workers matched on device to one depth share the prompt's terms: their TTFTs are
    their load terms plus one prefill time, and the smallest of a group is its smallest
    load term plus that (the same float: rounding an addition is monotone)."""

    # (prompt seconds: the prefill and any loading, cached tokens, load terms, workers)
    # per depth matched, per group a shared store continues, and for no match; a group
    # may be empty
    groups: list[tuple[float, int, list[float], list[WorkerLoad]]]
    apart: list[tuple[WorkerLoad, float, int]]  # holders with a host or storage block

    def deepest(self) -> int:
        """The most cached tokens of any worker (loops over the few groups: a
        comprehension is a call)."""
        groups, apart = self
        deepest = 0
        for _, cached, terms, _ in groups:
            if terms and cached > deepest:
                deepest = cached
        for _, _, cached in apart:
            if cached > deepest:
                deepest = cached
        return deepest

    def deepest_holders(self, deepest: int) -> Iterator[tuple[WorkerLoad, float]]:
        """The (worker, TTFT) of the workers with ``deepest`` cached tokens (:meth:`deepest`),
        if that is any: what the discount of the recompute weight reads
        (:meth:`FutureCost.weight`), one at a time, as it stops at the first whole chance."""
        if not deepest:
            return
        groups, apart = self
        yield from ((w, ttft) for w, ttft, cached in apart if cached == deepest)
        for prefill_s, cached, terms, workers in groups:
            if cached == deepest:
                for term, worker in zip(terms, workers, strict=True):
                    yield worker, term + prefill_s

    def scored(self) -> list[tuple[WorkerLoad, float, int]]:
        """Every worker's (worker, TTFT, cached tokens), as :func:`_choose` reads them."""
        scored = list(self.apart)
        for prefill_s, cached, terms, workers in self.groups:
            pairs = zip(terms, workers, strict=True)
            scored += [(w, term + prefill_s, cached) for term, w in pairs]
        return scored


# A TTFT within 2 ns of the smallest is counted against its load term: the bound
# on the term is loosened by this much, far above the rounding of subtracting the
# prefill time, so that no term that counts is missed (a loose count of one is exact)
_TERM_SLACK_S = 1e-9


def _choose_whole(fleet: _WholeFleet, tie_key: int) -> KvAwareChoice:
    """:func:`_choose` without a weight or a salt, from a whole fleet's groups: the
    same choice, with the smallest TTFT found per group in C and only the groups near
    it looked at worker by worker, where a tie needs it (a pass per worker for the
    scored triples, then four more over them in ``_choose``, were about a sixth of a
    100-worker decision's instructions). Loops over the few groups, not comprehensions:
    each of those is a call, which a 10-worker fleet's decision felt."""
    groups, apart = fleet
    lowest_s = none = float("inf")
    deepest = 0
    minima = []
    for prefill_s, cached, terms, _ in groups:
        if terms:
            least = min(terms) + prefill_s
            if cached > deepest:
                deepest = cached
            if least < lowest_s:
                lowest_s = least
        else:
            least = none
        minima.append(least)
    for _, ttft, cached in apart:
        if cached > deepest:
            deepest = cached
        if ttft < lowest_s:
            lowest_s = ttft
    near_s = lowest_s + 2e-9
    near: list[tuple[WorkerLoad, float, int]] = []
    if apart:
        near += [s for s in apart if s[1] <= near_s]
    lone = None
    for group, least in zip(groups, minima, strict=True):
        if least > near_s:
            continue
        prefill_s, cached, terms, workers = group
        bound = near_s - prefill_s + _TERM_SLACK_S
        # (a comprehension: a float's bound ``__ge__`` mapped in C goes through a method
        # wrapper per call, 4 % more instructions per 100-worker decision)
        if lone is None and not near and len([t for t in terms if t <= bound]) == 1:
            term = min(terms)
            lone = (workers[terms.index(term)], term + prefill_s, cached)
            continue
        if lone is not None:
            near.append(lone)
            lone = None
        near += [
            (w, term + prefill_s, cached)
            for term, w in zip(terms, workers, strict=True)
            if term + prefill_s <= near_s
        ]
    if lone is not None:
        return _chosen([lone], deepest, tie_key)
    return _chosen(_lightest(near), deepest, tie_key)


def _scorer(
    deepest: int, prompt_tokens: int, config: KvAwareConfig, weight: float
) -> Callable[[float, int], float]:
    """A candidate's score from its (TTFT, cached tokens), with a recompute ``weight``
    and ``config``'s home weight, given the ``deepest`` match of any candidate.

    The home term is ``home_weight`` × (the TTFT less the prefill: the wait there, and
    loading host or storage hits) × the share of the prompt computed there; with it the
    recompute term is scaled by the share of the prompt the deepest holder holds. For
    one number of cached tokens the score never falls as the TTFT grows: each step is a
    rounded addition or a product by a factor >= 0, which keep order."""
    floor_s = config.prefill_s(prompt_tokens - deepest, deepest) if weight else 0.0
    home = config.home_weight if prompt_tokens else 0.0  # no prompt: no shares
    if home:
        weight *= deepest / prompt_tokens

    prefills: dict[int, float] = {}  # cached tokens -> prefill seconds, per decision

    def score(ttft: float, cached: int) -> float:
        prefill_s = prefills.get(cached)
        if prefill_s is None:
            prefill_s = prefills[cached] = config.prefill_s(prompt_tokens - cached, cached)
        if home:
            ttft += home * (ttft - prefill_s) * (prompt_tokens - cached) / prompt_tokens
        if not weight or cached == deepest:
            return ttft
        return ttft + weight * (prefill_s - floor_s)

    return score


def _choose_whole_weighted(
    fleet: _WholeFleet,
    deepest: int,
    tie_key: int,
    prompt_tokens: int,
    config: KvAwareConfig,
    weight: float,
) -> KvAwareChoice:
    """:func:`_choose` with a weight (no salt), from a whole fleet's groups: the same
    choice. A group's workers share their match, so their scores are in the order of
    their load terms (:func:`_scorer`): the group's smallest score is its smallest
    term's, and only the groups whose smallest is within 2 ns of the lowest are scored
    worker by worker (every worker's score, then a rank each, made a weighted 100-worker
    decision cost three times an unweighted one). A score grows at least as fast as its
    load term (the home term adds a share of the wait, the recompute term a constant), so
    a term further than the gap to the lowest above its group's smallest is passed over
    unscored. ``deepest``: :meth:`_WholeFleet.deepest`."""
    groups, apart = fleet
    score = _scorer(deepest, prompt_tokens, config, weight)
    # (a loop over the few groups, not comprehensions: each of those is a call)
    lowest_s = math.inf
    minima: list[tuple[float, float]] = []  # (smallest score, smallest term) per group
    for prefill_s, cached, terms, _ in groups:
        if terms:
            least_term = min(terms)
            least = score(least_term + prefill_s, cached)
            if least < lowest_s:
                lowest_s = least
        else:
            least = least_term = math.inf
        minima.append((least, least_term))
    apart_scores = [score(ttft, cached) for _, ttft, cached in apart] if apart else []
    if apart_scores:
        lowest_s = min(lowest_s, *apart_scores)
    near_s = lowest_s + 2e-9
    near = [(s, value) for s, value in zip(apart, apart_scores, strict=True) if value <= near_s]
    for group, (least, least_term) in zip(groups, minima, strict=True):
        if least > near_s:
            continue
        prefill_s, cached, terms, workers = group
        bound = least_term + (near_s - least) + _TERM_SLACK_S
        scores: dict[float, float] = {}  # TTFT -> score: idle workers share one
        for term, worker in zip(terms, workers, strict=True):
            if term <= bound:
                ttft = term + prefill_s
                value = scores.get(ttft)
                if value is None:
                    value = scores[ttft] = score(ttft, cached)
                if value <= near_s:
                    near.append(((worker, ttft, cached), value))
    if len(near) == 1:  # most decisions: nothing to rank
        return _chosen([near[0][0]], deepest, tie_key)
    values = [value for _, value in near]
    keys = [s[0].sort_key for s, _ in near]
    if min(values) == max(values):  # one score (idle workers, say): the sort key ranks
        lowest_key = min(keys)
        tied = [s for (s, _), key in zip(near, keys, strict=True) if key == lowest_key]
        return _chosen(tied, deepest, tie_key)
    ranks = [(round(value, 9), key) for value, key in zip(values, keys, strict=True)]
    lowest = min(ranks)
    tied = [s for (s, _), rank in zip(near, ranks, strict=True) if rank == lowest]
    return _chosen(tied, deepest, tie_key)


def _ranks(
    scored: Sequence[tuple[WorkerLoad, float, int]],
    deepest: int,
    prompt_tokens: int,
    config: KvAwareConfig,
    weight: float,
    salt: ReplicaSalt | None,
) -> list[tuple[float, tuple[int, int]]]:
    """:func:`_choose`'s (score rounded to the nanosecond, sort key) per scored worker,
    with a recompute ``weight``, a home weight or a replica's ``salt``."""
    home = config.home_weight
    if weight or home:
        score = _scorer(deepest, prompt_tokens, config, weight)
        values = [score(ttft, cached) for _, ttft, cached in scored]
    else:  # a salt alone: the TTFT is the score
        values = list(map(itemgetter(1), scored))
    if salt is not None:
        values = [value + salt(s[0].worker_id) for value, s in zip(values, scored, strict=True)]
    return [(round(value, 9), s[0].sort_key) for value, s in zip(values, scored, strict=True)]


class KvAwareRouting:
    """The index and the rule together: what a router replica or the simulator holds."""

    def __init__(self, config: KvAwareConfig, index: KVBlockIndex | None = None) -> None:
        self.config = config
        # a weight applies only while the fleet has slack; without, the same costs rank
        self._weighted = bool(config.recompute_weight or config.home_weight)
        self._ttft_only = replace(config, recompute_weight=0.0, home_weight=0.0)
        # one weight alone, or the TTFT-only config where that weight is 0: a decision
        # whose config carries no weight takes the unweighted paths
        self._recompute_only = (
            replace(config, home_weight=0.0) if config.recompute_weight else self._ttft_only
        )
        self._home_only = (
            replace(config, recompute_weight=0.0) if config.home_weight else self._ttft_only
        )
        # the slack bounds as tokens: no prefill time computed per decision
        self._home_slack_tokens = config.tokens_within(config.home_slack_queue_s)
        self._recompute_slack_tokens = config.tokens_within(config.recompute_slack_queue_s)
        self.index = index if index is not None else KVBlockIndex(config.index_max_entries)
        self.loads = LoadOrder(
            config.prefill_s, config.decode_request_s, self.index.slot, len(TIERS)
        )
        self.queue = PrefillQueue(self.loads)
        # what the discount of the recompute weight reads: kept only where it is applied
        # (a weight of 0, the default, or a margin of 0 reads none of it)
        self.future: FutureCost | None = None
        if config.recompute_weight and config.retention_margin:
            pressure = HolderPressure(config.retention_margin, config.retention_window_s)
            self.future = FutureCost(pressure)
        self.salt: ReplicaSalt | None = None
        self.rank = 0  # this replica's place among its peers: how long it defers in a burst
        # when the salt and the stagger apply (None: always, where there is one)
        self.bursts: ArrivalBursts | None = None
        self.small_fleet = SMALL_FLEET  # fleets up to this size are predicted whole
        # the router's kept pool whose workers all have load entries (until one is forgotten)
        self._pool_known: PoolLoads | None = None

    def as_replica(self, replica: str, rank: int) -> None:
        """Route as the router replica named ``replica``, ranked ``rank`` among its peers:
        its decisions in a burst deferred by ``rank × replica_stagger_s``, its scores
        offset by its :class:`ReplicaSalt` (none with a ``replica_spread_s`` of 0)."""
        config = self.config
        spread_s, window_s = config.replica_spread_s, config.replica_burst_window_s
        self.salt = ReplicaSalt(replica, spread_s) if spread_s else None
        self.rank = rank
        staggered = rank and config.replica_stagger_s
        self.bursts = ArrivalBursts(window_s) if (spread_s or staggered) and window_s else None

    def decision_delay(self, now: float) -> float:
        """Seconds to wait, from a request's arrival at ``now``, before choosing for it.

        Replicas sharing a burst that decide at one instant each decide blind to the
        others' share of it, and send theirs to the same best workers (4 replicas, 10
        workers, the Mooncake trace's same-instant buckets: TTFT p99 +47 % over one
        router, salted). Deferred by rank, one step longer than an announcement takes,
        each replica decides after the lower ranks' choices in that burst have reached
        it: the burst is routed as one router would route it, in a slightly different
        order, for up to ``(replicas - 1) × replica_stagger_s`` of TTFT. Only in bursts:
        a stream spread in time has already been heard."""
        if not self.rank or (self.bursts is not None and not self.bursts.bursting):
            return 0.0
        return self.rank * self.config.replica_stagger_s

    def arrived(self, now: float) -> None:
        """A request reached this router at ``now`` (once per request, before choosing: a
        PD pair's two choices are one arrival), or a peer replica's choice was heard."""
        if self.bursts is not None:
            self.bursts.arrived(now)

    def _salt_now(self) -> ReplicaSalt | None:
        """The salt this decision adds: a replica's, while requests come in bursts."""
        if self.bursts is not None and not self.bursts.bursting:
            return None
        return self.salt

    def select(
        self,
        workers: Sequence[WorkerLoad],
        block_hashes: Sequence[int],
        prompt_tokens: int,
        block_size: int,
        now: float,
    ) -> KvAwareChoice:
        """Select for a request whose reusable full blocks hash to ``block_hashes``, then
        expect its prefill on the chosen worker."""
        self.arrived(now)
        choice = self.best(workers, block_hashes, prompt_tokens, block_size, now)
        self.expect_prefill(choice, block_hashes, prompt_tokens, now)
        return choice

    def best(
        self,
        workers: Sequence[WorkerLoad],
        block_hashes: Sequence[int],
        prompt_tokens: int,
        block_size: int,
        now: float,
    ) -> KvAwareChoice:
        """The worker with the smallest predicted TTFT; nothing is recorded.

        Only the holders of a prefix and the lightest loads are predicted (see the
        module docstring); a worker not seen before is learnt from ``workers``. A fleet
        of up to ``small_fleet`` workers (with a replica's salt ``SMALL_SALTED_FLEET``,
        or ``SMALL_WEIGHTED_FLEET`` with a weight too) is predicted whole: the reference
        rule, cheaper there than finding the few worth predicting. A replica's salt
        applies only while its requests arrive in bursts (:attr:`bursts`), each weight
        only while the fleet has slack for it (:meth:`_weights_now`).
        """
        tie_key = block_hashes[-1] if block_hashes else prompt_tokens
        config = self._weights_now(workers) if self._weighted else self._ttft_only
        weighted = config is not self._ttft_only
        salt = self._salt_now()
        whole = self.small_fleet
        if salt is not None:
            whole = min(whole, SMALL_WEIGHTED_FLEET if weighted else SMALL_SALTED_FLEET)
        if len(workers) <= whole:
            fleet = self._whole_fleet(workers, block_hashes, prompt_tokens, block_size, now)
            if salt is None:
                if not weighted:
                    return _choose_whole(fleet, tie_key)
                deepest = fleet.deepest()
                weight = self._weight(
                    config, lambda: fleet.deepest_holders(deepest), block_size, prompt_tokens, now
                )
                return _choose_whole_weighted(
                    fleet, deepest, tie_key, prompt_tokens, config, weight
                )
            scored = fleet.scored()
        else:
            candidates = self._candidates(workers, block_hashes, now, tie_key, salt is not None)
            scored = self._score(candidates, prompt_tokens, block_size, now)
        if not weighted:
            return _choose(scored, tie_key, prompt_tokens, self._ttft_only, 0.0, salt)
        weight = self._weight(
            config, lambda: _deepest_holders(scored), block_size, prompt_tokens, now
        )
        return _choose(scored, tie_key, prompt_tokens, config, weight, salt)

    def _weights_now(self, workers: Sequence[WorkerLoad]) -> KvAwareConfig:
        """The config whose weights apply to this decision: each weight kept while the
        mean worker's guarded prefill is within its slack bound
        (:attr:`KvAwareConfig.home_slack_queue_s`, :attr:`KvAwareConfig.
        recompute_slack_queue_s`), the others set to 0; ``_ttft_only`` when none is."""
        guarded = guarded_prefill_tokens(workers)
        count = len(workers)
        home = guarded <= self._home_slack_tokens * count
        recompute = guarded <= self._recompute_slack_tokens * count
        if home:
            return self.config if recompute else self._home_only
        return self._recompute_only if recompute else self._ttft_only

    def _score(
        self,
        candidates: Iterable[tuple[WorkerLoad, WorkerMatch]],
        prompt_tokens: int,
        block_size: int,
        now: float,
    ) -> list[tuple[WorkerLoad, float, int]]:
        """Each candidate's (worker, TTFT, cached tokens), the same floats as
        :func:`_ttft`'s: the load terms :class:`LoadOrder` keeps per worker (computed
        again only from a load object it was not given), the prompt's terms computed
        once per match (workers sharing a match share its object)."""
        entries = self.loads.entries
        by_match: dict[int, tuple[float, float, int]] = {}
        scored: list[tuple[WorkerLoad, float, int]] = []
        for worker, match in candidates:
            worker_id = worker.worker_id
            entry = entries.get(worker_id)
            if entry is None or entry.load is not worker:
                entry = self.loads.update(worker)
            prompt = by_match.get(id(match))
            if prompt is None:
                prompt = by_match[id(match)] = _prompt_terms(
                    match, prompt_tokens, block_size, self.config
                )
            term = load_term(entry, entry.done_at - now)
            scored.append((worker, term + (prompt[0] + prompt[1]), prompt[2]))
        return scored

    def _whole_fleet(
        self,
        workers: Sequence[WorkerLoad],
        block_hashes: Sequence[int],
        prompt_tokens: int,
        block_size: int,
        now: float,
    ) -> _WholeFleet:
        """Every worker of a small fleet scored, the same floats as :meth:`_score`'s,
        grouped by the index's layers of holders by depth: the prompt's terms computed
        once per depth, a worker found in its layer by a byte lookup, its load term
        appended to its layer's (a worker not seen before learnt here)."""
        layers, loading, apart_matches = self.index.holder_layers(block_hashes, now)
        entries, update = self.loads.entries, self.loads.update
        config = self.config
        by_layer: list[tuple[bytes, list[float], list[WorkerLoad]]] = []
        groups: list[tuple[float, int, list[float], list[WorkerLoad]]] = []
        for matched, members in layers:
            cached = min(matched * block_size, prompt_tokens)
            terms: list[float] = []
            held_by: list[WorkerLoad] = []
            by_layer.append((members, terms, held_by))
            groups.append(
                (config.prefill_s(prompt_tokens - cached, cached), cached, terms, held_by)
            )
        for through, members in loading:  # groups a shared store continues
            prefill_s, loading_s, cached = _prompt_terms(through, prompt_tokens, block_size, config)
            terms, held_by = [], []
            by_layer.append((members, terms, held_by))
            groups.append((prefill_s + loading_s, cached, terms, held_by))
        width = len(by_layer[0][0]) if by_layer else 0
        missed_terms: list[float] = []
        missed: list[WorkerLoad] = []
        apart: list[tuple[WorkerLoad, float, int]] = []
        for worker in workers:
            entry = entries.get(worker.worker_id)
            if entry is None or entry.load is not worker:
                entry = update(worker)
            # load_term, inlined: a call per worker of a whole fleet costs ~10% here
            queued_s = entry.done_at - now
            if queued_s <= 0.0:
                term = entry.fixed_s
            else:
                guarded_s = entry.guarded_s
                term = (queued_s if queued_s < guarded_s else guarded_s) + entry.fixed_s
            if apart_matches:
                match = apart_matches.get(worker.worker_id)
                if match is not None:
                    prefill_s, loading_s, cached = _prompt_terms(
                        match, prompt_tokens, block_size, config
                    )
                    apart.append((worker, term + (prefill_s + loading_s), cached))
                    continue
            byte = entry.mask_byte
            # past the layers' bytes: a worker learnt since the walk, which holds nothing
            for members, terms, held_by in by_layer if byte < width else ():
                if members[byte] & entry.mask_bit:
                    terms.append(term)
                    held_by.append(worker)
                    break
            else:
                missed_terms.append(term)
                missed.append(worker)
        groups.append((config.prefill_s(prompt_tokens, 0), 0, missed_terms, missed))
        return _WholeFleet(groups, apart)

    def _candidates(
        self,
        workers: Sequence[WorkerLoad],
        block_hashes: Sequence[int],
        now: float,
        tie_key: int,
        salted: bool,
    ) -> list[tuple[WorkerLoad, WorkerMatch]]:
        """The workers worth predicting, with their matches: the holders (the lightest of
        a group sharing one match) and the lightest non-holders (more of them where the
        choice is ``salted``)."""
        by_id = loads_by_id(workers)
        if workers is not self._pool_known:  # a pool kept by the router is tested once
            known = self.loads.known
            if not by_id.keys() <= known:  # a subset test allocates nothing; rarely false
                for worker_id in by_id.keys() - known:
                    self.loads.update(by_id[worker_id])
            if isinstance(workers, PoolLoads):
                self._pool_known = workers
        groups = self.index.holder_groups(block_hashes, now)
        chosen = [(w, match) for w, match in groups.apart.items() if w in by_id]
        for match, members in groups.shared:
            chosen += [(w, match) for w in self._lightest_holders(members, by_id, now, tie_key)]
        # every worker a holder (a fleet sharing a store that holds the prompt): none is
        # left to find, and the search would walk the whole of each load order
        everyone = len(groups.every) >= self.index.num_workers
        lightest = (
            () if everyone else self._lightest_loads(by_id, groups.every, now, tie_key, salted)
        )
        chosen += [(w, _NO_MATCH) for w in lightest]
        return [(by_id[w], match) for w, match in chosen]

    def _lightest_loads(
        self,
        by_id: Mapping[str, WorkerLoad],
        holders: Container[str],
        now: float,
        tie_key: int,
        salted: bool,
    ) -> set[str]:
        """The non-holders worth predicting: the lightest; for a ``salted`` choice, the
        lightest few (``SALTED_LOAD_ROUNDS`` walks of the orders), among which the salt
        can pick another than its peers' lightest."""
        found = self.loads.lightest(by_id, holders, now, tie_key)
        if not salted:
            return found
        for _ in range(SALTED_LOAD_ROUNDS - 1):
            more = self.loads.lightest(by_id, _Either(holders, found), now, tie_key)
            if not more:
                break
            found |= more
        return found

    def _weight(
        self,
        config: KvAwareConfig,
        deepest_holders: Callable[[], Iterable[tuple[WorkerLoad, float]]],
        block_size: int,
        prompt_tokens: int,
        now: float,
    ) -> float:
        """``config``'s recompute weight for this decision, discounted by holder pressure:
        the (worker, TTFT) of the candidates matched deepest, read only for a discount."""
        base, future = config.recompute_weight, self.future
        if future is None or not base:  # no weight, or no discount
            return base
        holders = deepest_holders()
        return future.weight(base, holders, self.index.num_blocks, block_size, prompt_tokens, now)

    def _lightest_holders(
        self, members: int, eligible: Mapping[str, WorkerLoad], now: float, tie_key: int
    ) -> list[str]:
        """The holders worth predicting of a group sharing one match (``members``: the
        first bits of their slots). They differ only by their load term, so where many
        share one (a popular system prompt, speculated wherever it was routed) only the
        lightest of them can win: a small group is listed and scanned for the load term
        :class:`LoadOrder` keeps (holders tied in (load term, sort key) all stay, for
        :func:`_choose` to break), a large one searched in its arrays without being
        listed (of those tied, one stays, chosen by the request's tie key, as for the
        lightest non-holders: a tie of a large group breaks among the candidates).
        """
        if members.bit_count() > GROUP_SCAN:
            return self.loads.lightest_of_slots(members, eligible, now, tie_key)
        group = [w for w in self.index.members(members) if w in eligible]
        return group if len(group) < 3 else self.loads.lightest_among(group, now)

    def expect_prefill(
        self, choice: KvAwareChoice, block_hashes: Sequence[int], prompt_tokens: int, now: float
    ) -> TakeBack:
        """The chosen worker computes the prompt's uncached part: queue it there and
        expect its blocks there. Returns what takes both back."""
        worker_id, cached = choice.worker_id, choice.prediction.cached_tokens
        seconds = self.config.prefill_s(prompt_tokens - cached, cached)
        ends_at = self.queue.push(worker_id, seconds, now)
        self.routed(worker_id, prompt_tokens)
        withdraw = self.expect_blocks(worker_id, block_hashes, now)

        def take_back(at: float) -> None:
            self.queue.take_back(worker_id, seconds, ends_at, at)
            withdraw(at)

        return take_back

    def routed(self, worker_id: str, prompt_tokens: int) -> None:
        """A ``prompt_tokens`` request went to ``worker_id``, its prompt held in the
        worker's cache while it runs (for the discount of the weight, where applied)."""
        if self.future is not None:
            self.future.routed(worker_id, prompt_tokens)

    def observe_events(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        """A worker's KV events, in order: into the index (and the eviction rate the
        discount of the weight reads, where applied)."""
        apply = self.index.apply
        for event in events:
            apply(worker_id, event)
        if self.future is not None:
            self.future.observe(worker_id, events)

    def expect_blocks(self, worker_id: str, block_hashes: Sequence[int], now: float) -> TakeBack:
        """Insert ``block_hashes`` speculatively on ``worker_id`` until events confirm them
        (a PD decode worker gets them from its prefill worker, computing nothing).
        Returns what withdraws them."""
        deadline = now + self.config.speculative_ttl_s
        if self.config.speculative_ttl_s > 0:
            self.index.speculate(worker_id, block_hashes, deadline)

        def withdraw(_: float) -> None:
            self.index.withdraw(worker_id, block_hashes, deadline)

        return withdraw

    def forget_worker(self, worker_id: str) -> None:
        self.index.remove_worker(worker_id)
        if self.future is not None:
            self.future.forget(worker_id)
        self.loads.remove(worker_id)
        self._pool_known = None
