"""Continuous batching over a paged, prefix-cached KV pool.

Each step fills a token budget: running decodes first (one token each, they are what
users wait on between tokens), then running prefills, then new admissions in arrival
order, each chunked to what is left of the budget. A new request starts from its
longest cached prefix; one whose next block another running request is computing right
now waits for that block to be committed instead of computing it a second time. When a
running request cannot grow, the newest running request is preempted by recompute: its
computed blocks are already committed to the prefix tree, so when it comes back it
matches them and recomputes only the rest.

Pure logic: the caller runs the model and reports back through :meth:`Scheduler.advance`.
"""

from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass, field

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_connector import SchedulerConnector
from kvserve.core.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    # Fraction of the pool kept free at admission, so running requests can grow a few
    # steps without an immediate preemption.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if not 0 <= self.watermark < 1:
            raise ValueError("watermark must be in [0, 1)")


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int  # first token position to compute (tokens before it are in KV)
    num_tokens: int  # tokens to compute this step (prefill chunk or 1 for decode)

    @property
    def completes_sequence(self) -> bool:
        """After this chunk the request's next token can be sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # decodes first, then prefill chunks
    preempted: list[Request]
    finished_before_run: list[Request]  # too long for the whole KV pool

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prompt tokens served from the prefix cache: the only count of it (the worker
    exports it as ``kvserve_prefix_cache_*``), taken once per request when it is first
    admitted; a retried admission or a preempted request's return matches again but
    does not count again."""

    num_requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    computed_tokens: int = 0  # every token run through the model, recomputation included
    preemptions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class _StepPlan:
    budget: int
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)
    # Hashes of prompt blocks that running requests are computing but have not committed.
    in_flight: set[int] = field(default_factory=set)


class _Admission(enum.Enum):
    ADMITTED = enum.auto()
    NO_ROOM = enum.auto()  # no blocks or budget: later arrivals wait too
    DEFERRED = enum.auto()  # its next block is being computed: later arrivals may go


def _by_arrival(request: Request) -> int:
    return request.arrival_order


def _add_in_flight(request: Request, in_flight: set[int]) -> None:
    """The prompt blocks ``request`` will compute and commit, if it is still prefilling."""
    if not request.is_decoding:
        in_flight.update(request.reusable_block_hashes()[request.num_committed_blocks :])


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        config: SchedulerConfig | None = None,
        connector: SchedulerConnector | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.config = config or SchedulerConfig()
        self.block_size = kv_cache.block_size
        self.watermark_blocks = math.ceil(self.config.watermark * kv_cache.num_blocks)
        # Both kept in arrival order: the oldest request is served first, the newest
        # running one is the first to be preempted.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._next_arrival = 0
        self.stats = PrefixCacheStats()
        # KV tiers, PD: asked before an admission, told of arrivals, preemptions and ends.
        self._connector = connector

    # -- requests in and out -------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.arrival_order = self._next_arrival
        self._next_arrival += 1
        self._requests[request.request_id] = request
        self.waiting.append(request)
        if self._connector is not None:
            self._connector.request_added(request)

    def finish(self, request: Request, reason: str) -> None:
        """Leave the batch and give every block back (cached ones stay in the tree)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            return
        self.kv_cache.free_request(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]
        if self._connector is not None:
            self._connector.request_finished(request)

    def abort(self, request_id: str) -> Request | None:
        request = self._requests.get(request_id)
        if request is not None:
            self.finish(request, "abort")
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens still to compute before requests reach decode (their queued work)."""
        return sum(r.num_uncomputed_tokens for r in self._requests.values() if not r.is_decoding)

    # -- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        # Decodes first, each part in arrival order (``running`` already is): a stable
        # partition, with no sort.
        decoding: list[Request] = []
        prefilling: list[Request] = []
        for request in self.running:
            (decoding if request.is_decoding else prefilling).append(request)
        for request in decoding + prefilling:
            if plan.budget == 0:
                break
            if request.status is RequestStatus.RUNNING:
                self._schedule_running(request, plan)
        if not plan.preempted:
            self._admit_waiting(plan)
        # Insertion order is already decodes, running prefills, then admissions.
        return SchedulerOutput(list(plan.chunks.values()), plan.preempted, plan.rejected)

    def _schedule_running(self, request: Request, plan: _StepPlan) -> None:
        num_new = min(request.num_uncomputed_tokens, plan.budget)
        target = request.num_computed_tokens + num_new
        while not self.kv_cache.allocate_slots(request.request_id, target):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return
        plan.chunks[request.request_id] = ScheduledChunk(
            request, request.num_computed_tokens, num_new
        )
        plan.budget -= num_new

    def _preempt(self, victim: Request, plan: _StepPlan) -> None:
        chunk = plan.chunks.pop(victim.request_id, None)
        if chunk is not None:
            plan.budget += chunk.num_tokens
        self.running.remove(victim)
        if self._connector is not None:
            self._connector.before_preempt(victim)
        self.kv_cache.free_request(victim.request_id)
        victim.status = RequestStatus.WAITING
        victim.num_computed_tokens = 0
        victim.num_committed_blocks = 0
        self.stats.preemptions += 1
        bisect.insort(self.waiting, victim, key=_by_arrival)
        plan.preempted.append(victim)

    def _admit_waiting(self, plan: _StepPlan) -> None:
        capacity = self.kv_cache.num_blocks * self.block_size
        connector = self._connector
        for running in self.running:
            _add_in_flight(running, plan.in_flight)
        index = 0  # waiting requests before it are still loading their KV: they wait
        while (
            index < len(self.waiting)
            and plan.budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[index]
            if request.max_num_tokens > capacity:
                self.waiting.pop(index)
                self._reject(request, plan)
                continue
            if connector is not None and not connector.may_admit(request):
                index += 1
                continue
            admission = self._try_admit(request, plan)
            if admission is _Admission.NO_ROOM and (self.running or index > 0):
                return
            if admission is _Admission.NO_ROOM:
                # Nothing runs, yet the oldest request finds no room: blocks are pinned by
                # requests behind it (a decode worker's leases, handed over after it
                # queued). Rather than idle for ever, the first one behind that fits may
                # go; the oldest keeps its place and goes once that one is done.
                index += 1
                continue
            if admission is _Admission.DEFERRED:
                index += 1
                continue
            self.waiting.pop(index)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_by_arrival)
            _add_in_flight(request, plan.in_flight)

    def _reject(self, request: Request, plan: _StepPlan) -> None:
        """It could never fit, even alone: running it would preempt itself forever."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = "length"
        del self._requests[request.request_id]
        plan.rejected.append(request)
        if self._connector is not None:
            self._connector.request_finished(request)

    def _try_admit(self, request: Request, plan: _StepPlan) -> _Admission:
        """Match the cached prefix and allocate the first chunk, or change nothing.

        Deferring a request whose next block is in flight trades one step of its TTFT
        for the whole shared prefix's compute: with many requests behind one system
        prompt, admitting them together would compute that prompt once per request.
        """
        reserve = self.watermark_blocks if self.running else 0
        if self.kv_cache.num_available_blocks - 1 < reserve:
            # Even a full match leaves one block to allocate: skip pinning the prefix
            # only to release it.
            return _Admission.NO_ROOM
        request_id = request.request_id
        reusable = request.reusable_block_hashes()
        matched = self.kv_cache.match_prefix(request_id, reusable)
        if matched < len(reusable) and reusable[matched] in plan.in_flight:
            self.kv_cache.free_request(request_id)
            return _Admission.DEFERRED
        num_cached = matched * self.block_size
        num_new = min(request.num_tokens - num_cached, plan.budget)
        new_blocks = -(-(num_cached + num_new) // self.block_size) - matched
        keeps_watermark = self.kv_cache.num_available_blocks - new_blocks >= reserve
        if not (keeps_watermark and self.kv_cache.allocate_slots(request_id, num_cached + num_new)):
            self.kv_cache.free_request(request_id)
            return _Admission.NO_ROOM
        request.num_computed_tokens = num_cached
        request.num_committed_blocks = matched
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
            self.stats.num_requests += 1
            self.stats.prompt_tokens += request.num_prompt_tokens
            self.stats.cached_prompt_tokens += num_cached
        plan.chunks[request_id] = ScheduledChunk(request, num_cached, num_new)
        plan.budget -= num_new
        return _Admission.ADMITTED

    def advance(self, output: SchedulerOutput) -> None:
        """Record that the model computed every scheduled chunk; commit full blocks.

        Committing as blocks fill (generated tokens too) lets a follow-up turn that
        quotes this answer hit the cache, and makes preemption cheap to undo.
        """
        for chunk in output.chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            self.stats.computed_tokens += chunk.num_tokens
            num_full = request.num_computed_tokens // self.block_size
            if num_full > request.num_committed_blocks:
                self.kv_cache.commit_blocks(
                    request.request_id, request.computed_block_hashes(), request.token_ids
                )
                request.num_committed_blocks = num_full
