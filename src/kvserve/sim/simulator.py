"""The discrete-event loop: a trace's arrivals and the workers' step ends, in virtual time.

Everything that decides is the servers' own code: per worker a
:class:`~kvserve.core.kv_cache_manager.KVCacheManager` and the core scheduler, and the
router's own routing policy objects (:func:`kvserve.core.routing.policies.make_policy`),
driven with the router's calls: ``select`` on the loads the router's guards would hold
(in-flight requests, and prompt tokens until the first token), and ``observe_events``
with what each worker's cache emitted after each step; a
:class:`~kvserve.core.cost_model.CostModel` stands in for the GPU. Events are kept in a
heap; arrivals are already sorted and are merged in from the trace, and a worker's steps
run back to back while it has work.

A request's query is built from its trace entry: ``text`` has one character per trace
block (distinct blocks, distinct characters, so ``cache_aware``'s matched fraction is a
fraction of blocks), ``blocks`` the engine's own hashes of its tokens (for
``kv_aware``), ``session_key`` the trace's session field (Mooncake and Azure traces have none, so
``session`` routes every request by load there).

With ``router_replicas`` R > 1, requests go to R router replicas in turn, each with its
own policy object and guards, all fed every worker's events (:mod:`kvserve.sim.replicas`).
With ``announce_delay_s`` set, each replica announces its choices and guard changes to
the others, delivered that many seconds later (before any arrival at the same instant).

With ``prefill_workers`` P > 0 the fleet is disaggregated: P prefill workers (``p0``...)
and the rest decode workers (``d0``...). Each request's pair is the policy's
``select_pair`` on the two pools' loads, the decode workers' KV headroom exact at the
decision (the router polls it every 0.5 s), as :mod:`kvserve.router.pd_proxy` calls it;
the decode worker reserves as the real one does and, when the prompt is worth it, the
prefill worker computes the prompt's full blocks plus one token, then the blocks the
decode worker lacks travel for the transfer model's time, are installed, and the decode
worker computes the rest and decodes (:mod:`kvserve.sim.disaggregation`). Guards as the
router's: the prefill worker holds one request and the prompt's tokens until the KV is
installed (the decode worker's response headers), or until the first token when the
decode worker prefills after all; the decode worker holds one request (and the prompt's
tokens until the first token when the router predicted a local prefill). A request's
cached tokens are the prompt tokens no worker computed for it. One router replica.

With ``store_tokens`` > 0 every worker of a mixed fleet writes through to one shared KV
store of that many tokens and loads from it (:mod:`kvserve.sim.shared_store`); the
policies hear of it as the router does, from each worker's snapshot and storage events.

``global`` is the reference ceiling: N schedulers (N GPUs) over one shared cache of N×T
tokens, so every request finds every prefix ever computed and still in that cache; with
it, routing has only load to decide.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.core.cost_model import CostModel
from kvserve.core.hashing import make_namespace
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_events import KVEvent
from kvserve.core.request import Request, RequestStatus
from kvserve.core.routing.announcements import Announcement
from kvserve.core.routing.cache_aware import CacheAwareConfig
from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.routing.policies import POLICY_NAMES, make_policy
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.types import PromptBlocks, RouteQuery
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import SchedulerConfig
from kvserve.sim.disaggregation import (
    Reservation,
    TransferModel,
    growth_blocks,
    install,
    prefill_request,
    release,
    reserve,
)
from kvserve.sim.replicas import RouterReplica
from kvserve.sim.shared_store import STORE_ID, SimStore
from kvserve.sim.trace import BLOCK_TOKENS, TraceRequest
from kvserve.sim.worker import SimWorker

GLOBAL = "global"  # least_loaded over one shared cache: the ceiling
POLICIES = (*POLICY_NAMES, GLOBAL)
MODEL = "sim"  # the namespace of the simulated model's blocks
_NAMESPACE = make_namespace(MODEL)
_FIRST_BLOCK_CHAR = 0x10000  # above the BMP's surrogates: every hash id is one code point


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_workers: int
    cache_tokens: int  # per worker
    cost: CostModel
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    seed: int = 0
    kv_aware: KvAwareConfig = field(default_factory=KvAwareConfig)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    router_replicas: int = 1  # requests go to them in turn (see kvserve.sim.replicas)
    # None: a replica sees its own guards only; 0: every worker reports before each
    # decision (replicas that announce every choice to each other at once)
    load_report_interval_s: float | None = None
    # None: replicas announce nothing; else their announcements arrive after this delay
    announce_delay_s: float | None = None
    # > 0: a disaggregated fleet, this many of the workers prefill, the rest decode
    prefill_workers: int = 0
    pd: PDConfig = field(default_factory=PDConfig)
    transfer_gbps: float = 12.5  # one 100 Gb/s NIC's worth, in GB/s
    transfer_latency_s: float = 1e-3  # per transfer: connection, request, install
    store_tokens: int = 0  # > 0: a KV store of this many tokens the whole fleet shares
    store_load_token_s: float = 10e-6  # loading from it (kv_aware's storage_load_token_s)

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if not 0 <= self.prefill_workers < self.num_workers:
            raise ValueError("prefill_workers must be >= 0 and leave a decode worker")
        if self.prefill_workers and self.router_replicas > 1:
            raise ValueError("a prefill/decode fleet is simulated behind one router replica")
        self.transfer_model()  # validates
        if self.router_replicas < 1:
            raise ValueError("router_replicas must be >= 1")
        if self.load_report_interval_s is not None and self.load_report_interval_s < 0:
            raise ValueError("load_report_interval_s must be >= 0 (0: before every decision)")
        if self.announce_delay_s is not None and self.announce_delay_s < 0:
            raise ValueError("announce_delay_s must be >= 0")
        if self.cache_tokens < BLOCK_TOKENS:
            raise ValueError(f"cache_tokens must hold at least one {BLOCK_TOKENS}-token block")
        if self.store_tokens and self.store_tokens < BLOCK_TOKENS:
            raise ValueError(f"store_tokens must hold at least one {BLOCK_TOKENS}-token block")
        if self.store_tokens < 0 or self.store_load_token_s < 0:
            raise ValueError("store_tokens and store_load_token_s must be >= 0")
        if self.store_tokens and self.prefill_workers:
            raise ValueError("a shared store is simulated for mixed fleets only")

    @property
    def blocks_per_worker(self) -> int:
        return self.cache_tokens // BLOCK_TOKENS

    def transfer_model(self) -> TransferModel:
        return TransferModel(
            self.transfer_gbps, self.transfer_latency_s, self.cost.kv_bytes_per_token
        )


@dataclass(frozen=True, slots=True)
class RequestRecord:
    arrival_s: float
    first_token_s: float | None  # None: rejected (longer than a worker's whole cache)
    finish_s: float | None
    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    # PD fleets: the prefill worker whose KV the decode worker installed (None: prefilled
    # on the decode worker) and how long that transfer took
    prefill_worker_id: str | None = None
    transfer_s: float | None = None


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    records: list[RequestRecord]
    computed_tokens: dict[str, int]  # per worker, recomputation included
    busy_s: dict[str, float]
    preemptions: int
    wall_s: float
    prefill_workers: tuple[str, ...] = ()  # PD fleets: the prefill pool
    # Requests still waiting when nothing was left to happen (see docs/internals.md,
    # "Simulating prefill/decode fleets": a decode worker's leases can starve its queue)
    unfinished: int = 0
    store_loaded_tokens: int | None = None  # with a shared store: tokens loaded from it


@dataclass(slots=True)
class _PairState:
    """A request of a PD fleet: its pair, what its guards hold, where its KV stands."""

    request: Request
    decode_id: str
    prefill_id: str | None  # the router's choice; None: predicted local
    decode_tokens: int = 0  # the prompt tokens the decode worker's guard holds
    prefill_released: bool = False
    reservation: Reservation | None = None  # a lease, when the decode worker took one
    prefill_cached: int | None = None  # the prefill worker's cached tokens, once it ran
    transfer_s: float | None = None


def build_policy(name: str, config: SimConfig) -> Policy:
    """The router's policy called ``name`` (``global``: least_loaded), tuned as in
    ``config``."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {POLICIES}")
    return make_policy(
        "least_loaded" if name == GLOBAL else name,
        0.0,
        seed=config.seed,
        cache_aware=config.cache_aware,
        kv_aware=config.kv_aware,
    )


def route_query(spec: TraceRequest, request: Request, with_blocks: bool) -> RouteQuery:
    """What the router would know of ``spec``'s request (see the module docstring)."""
    blocks = None
    if with_blocks:
        hashes = request.reusable_block_hashes()
        blocks = PromptBlocks(request.num_prompt_tokens, hashes, BLOCK_TOKENS)
    return RouteQuery(
        text="".join(chr(_FIRST_BLOCK_CHAR + h) for h in spec.hash_ids),
        model=MODEL,
        session_key=spec.session_key,
        prefill_tokens=request.num_prompt_tokens,
        blocks=blocks,
    )


class Simulation:
    def __init__(self, policy_name: str, config: SimConfig) -> None:
        self.policy_name = policy_name
        self.config = config
        ids = [f"w{i}" for i in range(config.num_workers)]
        announce = config.announce_delay_s is not None and config.router_replicas > 1
        self._prefill_ids = [f"p{i}" for i in range(config.prefill_workers)]
        decoders = config.num_workers - config.prefill_workers if config.prefill_workers else 0
        self._decode_ids = [f"d{i}" for i in range(decoders)]
        if config.prefill_workers:
            if policy_name == GLOBAL:
                raise ValueError("global is a mixed fleet's ceiling: no PD fleet")
            ids = self._prefill_ids + self._decode_ids
        self.replicas = [
            RouterReplica(
                build_policy(policy_name, config),
                ids,
                f"r{i}",
                announce,
                one_of_several=config.router_replicas > 1,
                rank=i,
            )
            for i in range(config.router_replicas)
        ]
        scheduler_config = SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs)
        if policy_name == GLOBAL:
            shared = KVCacheManager(config.blocks_per_worker * config.num_workers, BLOCK_TOKENS)
            caches = [shared] * config.num_workers
        else:
            caches = [KVCacheManager(config.blocks_per_worker, BLOCK_TOKENS) for _ in ids]
        self._shared_cache = policy_name == GLOBAL
        # global's one cache already holds every prefix the fleet computed: no store
        self.store = (
            SimStore(config.store_tokens // BLOCK_TOKENS, config.store_load_token_s)
            if config.store_tokens and not self._shared_cache
            else None
        )
        self.workers = {
            w: SimWorker(w, cache, config.cost, scheduler_config, self.store)
            for w, cache in zip(ids, caches, strict=True)
        }
        if self.store is not None:
            for replica in self.replicas:
                for worker_id in ids:
                    replica.policy.observe_store(worker_id, STORE_ID)
        self._routed = 0
        self._next_report = 0.0
        self._steps: list[tuple[float, int, str]] = []  # (end time, order, worker)
        self._step_of: dict[str, int] = {}  # worker -> the order of its step in flight
        # (arrival time, order, sender, announcement) of announcements under way
        self._deliveries: list[tuple[float, int, int, Announcement]] = []
        # (decision time, order, arrival time, trace entry, request, replica index) of
        # arrivals whose replica defers its decision (Policy.decision_delay)
        self._deferred: list[tuple[float, int, float, TraceRequest, Request, int]] = []
        self._order = 0
        self._arrivals: dict[str, float] = {}
        self._first_tokens: dict[str, float] = {}
        self._served_by: dict[str, tuple[str, RouterReplica]] = {}
        self.records: list[RequestRecord] = []
        self._transfer = config.transfer_model()
        self._pairs: dict[str, _PairState] = {}  # PD fleets: request id -> its state
        self._exports: dict[str, _PairState] = {}  # prefill workers' request id -> pair
        self._transfers: list[tuple[float, int, str]] = []  # (end time, order, request id)
        self._leased: dict[str, list[Request]] = {w: [] for w in self._decode_ids}
        # leased, not yet queued on their decode worker: prefilling or in transfer
        self._in_transfer: dict[str, list[Request]] = {w: [] for w in self._decode_ids}

    def run(
        self, trace: Sequence[TraceRequest], progress: Callable[[int], None] | None = None
    ) -> SimResult:
        started = time.perf_counter()
        next_arrival = 0
        while (
            next_arrival < len(trace)
            or self._steps
            or self._deliveries
            or self._transfers
            or self._deferred
        ):
            arrival_time = trace[next_arrival].arrival_s if next_arrival < len(trace) else None
            step_time = self._steps[0][0] if self._steps else None
            if self._deliveries and all(
                t is None or self._deliveries[0][0] <= t for t in (arrival_time, step_time)
            ):
                self._deliver(*heapq.heappop(self._deliveries))
            elif self._deferred and all(
                t is None or self._deferred[0][0] <= t for t in (arrival_time, step_time)
            ):
                now, _, arrived, spec, request, replica = heapq.heappop(self._deferred)
                self._route(
                    spec,
                    request,
                    self.replicas[replica],
                    arrived,
                    now,
                    self._horizon(trace, next_arrival),
                )
            elif self._transfers and all(
                t is None or self._transfers[0][0] <= t for t in (arrival_time, step_time)
            ):
                now, _, request_id = heapq.heappop(self._transfers)
                self._transfer_ended(request_id, now, self._horizon(trace, next_arrival))
            elif self._steps and (arrival_time is None or self._steps[0][0] <= arrival_time):
                now, order, worker_id = heapq.heappop(self._steps)
                if self._step_of[worker_id] == order:  # else a wait an arrival cut short
                    self._end_step(self.workers[worker_id], now, trace, next_arrival)
            else:
                assert arrival_time is not None
                next_arrival += 1
                self._arrive(trace[next_arrival - 1], arrival_time, trace, next_arrival)
                if progress is not None:
                    progress(next_arrival)
        return SimResult(
            policy=self.policy_name,
            records=self.records,
            computed_tokens={
                w: worker.scheduler.stats.computed_tokens for w, worker in self.workers.items()
            },
            busy_s={w: worker.busy_s for w, worker in self.workers.items()},
            preemptions=sum(w.scheduler.stats.preemptions for w in self.workers.values()),
            wall_s=time.perf_counter() - started,
            prefill_workers=tuple(self._prefill_ids),
            unfinished=len(self._arrivals),
            store_loaded_tokens=None if self.store is None else self.store.loaded_tokens,
        )

    def _horizon(self, trace: Sequence[TraceRequest], next_arrival: int) -> float:
        """The earliest a request may join a worker's queue: the next arrival, and in a PD
        fleet also the next transfer's end, or a prefill step's end (a transfer starts,
        ending no sooner than its latency, or the decode worker falls back at once). A
        decode run planned past it would keep that request waiting for the run's end."""
        arrival = trace[next_arrival].arrival_s if next_arrival < len(trace) else float("inf")
        if self._deferred:  # a deferred decision is an arrival at its worker
            arrival = min(arrival, self._deferred[0][0])
        if not self._prefill_ids:
            return arrival
        transfer = self._transfers[0][0] if self._transfers else float("inf")
        prefill_ends = (self.workers[w].busy_until for w in self._prefill_ids)
        prefill = min((t for t in prefill_ends if t is not None), default=float("inf"))
        return min(arrival, transfer, prefill)

    def _arrive(
        self, spec: TraceRequest, now: float, trace: Sequence[TraceRequest], next_arrival: int
    ) -> None:
        request = Request(
            spec.request_id,
            spec.prompt_token_ids(),
            SamplingParams(max_tokens=spec.output_tokens),
            max_tokens=spec.output_tokens,
            namespace=_NAMESPACE,
            block_size=BLOCK_TOKENS,
        )
        self._report_loads(now)
        if self._prefill_ids:
            self._route_pair(spec, request, now, self._horizon(trace, next_arrival))
            return
        index = self._routed % len(self.replicas)
        replica = self.replicas[index]
        self._routed += 1
        delay = replica.policy.decision_delay(now)
        if delay > 0:  # as the router's proxy sleeps before it selects
            item = (now + delay, self._order, now, spec, request, index)
            heapq.heappush(self._deferred, item)
            self._order += 1
            return
        self._route(spec, request, replica, now, now, self._horizon(trace, next_arrival))

    def _route(
        self,
        spec: TraceRequest,
        request: Request,
        replica: RouterReplica,
        arrived: float,
        now: float,
        horizon: float,
    ) -> None:
        """``replica`` chooses at ``now`` for ``request``, which arrived at ``arrived``,
        and the worker takes it."""
        query = route_query(spec, request, replica.policy.reads_prompt_blocks)
        worker_id = replica.select(query, now).worker_id
        replica.adjust(worker_id, 1, request.num_prompt_tokens)
        self._announce(replica, now)
        self._arrivals[spec.request_id] = arrived
        self._served_by[spec.request_id] = (worker_id, replica)
        worker = self.workers[worker_id]
        worker.add(request)
        if worker.waiting_for_load:  # idle but for a load: the new request may run now
            worker.stop_waiting()
        if worker.busy_until is None:
            self._start(worker, now, horizon)

    def _announce(self, replica: RouterReplica, now: float) -> None:
        """Send what ``replica`` has to announce to every other replica."""
        announcement = replica.announcement()
        if announcement is None:
            return
        assert self.config.announce_delay_s is not None
        at = now + self.config.announce_delay_s
        heapq.heappush(
            self._deliveries, (at, self._order, self.replicas.index(replica), announcement)
        )
        self._order += 1

    def _deliver(self, now: float, _order: int, sender: int, announcement: Announcement) -> None:
        for i, replica in enumerate(self.replicas):
            if i != sender:
                replica.deliver(announcement, now)

    def _report_loads(self, now: float) -> None:
        """Each worker reports what all replicas have in flight on it, every interval."""
        interval = self.config.load_report_interval_s
        if interval is None or len(self.replicas) == 1 or (interval and now < self._next_report):
            return
        self._next_report = now + interval
        for worker_id in self.workers:
            requests = sum(r.requests[worker_id] for r in self.replicas)
            tokens = sum(r.prefill_tokens[worker_id] for r in self.replicas)
            for replica in self.replicas:
                replica.learn_report(worker_id, requests, tokens)

    def _start(self, worker: SimWorker, now: float, horizon: float) -> None:
        duration = worker.start_step(now, horizon)
        if duration is not None:
            heapq.heappush(self._steps, (now + duration, self._order, worker.worker_id))
            self._step_of[worker.worker_id] = self._order
            self._order += 1

    def _end_step(
        self, worker: SimWorker, now: float, trace: Sequence[TraceRequest], next_arrival: int
    ) -> None:
        result = worker.finish_step()
        touched: dict[int, RouterReplica] = {}
        for request in result.first_tokens:
            if request.request_id in self._exports:
                continue  # a prefill worker's part: it ends with this token
            self._first_tokens[request.request_id] = now
            replica = self._first_token(request, worker.worker_id)
            touched[id(replica)] = replica
        for request in result.finished:
            state = self._exports.pop(request.request_id, None)
            if state is not None:
                self._export_ended(state, request, now, self._horizon(trace, next_arrival))
                continue
            replica = self._record(request, now)
            touched[id(replica)] = replica
        self._release_admitted_leases(worker)
        for replica in touched.values():
            self._announce(replica, now)
        if not self._shared_cache:
            events = worker.new_events()
            if self.store is not None:
                events = [*events, *self._write_through(events)]
            for replica in self.replicas:
                replica.policy.observe_events(worker.worker_id, events)
        horizon = self._horizon(trace, next_arrival)  # transfers started above count
        # With one shared cache a worker may have waited for blocks another one freed.
        waiting = self.workers.values() if self._shared_cache else (worker,)
        for candidate in waiting:
            if candidate.busy_until is None and candidate.has_work:
                self._start(candidate, now, horizon)

    def _write_through(self, events: Sequence[KVEvent]) -> list[KVEvent]:
        """Write the blocks a worker's step committed to the shared store; its storage
        events, as that worker would announce them: each write, then what it evicted."""
        assert self.store is not None
        writes = [
            KVEvent(0, "stored", "storage", event.block_hashes, event.parent_hash)
            for event in events
            if event.kind == "stored" and event.tier == "device"
        ]
        evicted = [h for write in writes for h in self.store.write(write.block_hashes)]
        if evicted:
            writes.append(KVEvent(0, "removed", "storage", tuple(evicted)))
        return writes

    def _record(self, request: Request, now: float) -> RouterReplica:
        """Record a finished request; returns the replica that routed it."""
        request_id = request.request_id
        worker_id, replica = self._served_by.pop(request_id)
        first = self._first_tokens.pop(request_id, None)
        state = self._pairs.pop(request_id, None)
        guarded = request.num_prompt_tokens if state is None else state.decode_tokens
        # rejected before running: its prompt never became a first token
        replica.adjust(worker_id, -1, -guarded if first is None else 0)
        cached = request.num_cached_tokens or 0
        transferred = state is not None and state.transfer_s is not None
        if state is not None:
            self._release_prefill(state, replica)
            if state.prefill_cached is not None and first is not None:
                cached = state.prefill_cached  # the prompt tokens no worker computed
        self.records.append(
            RequestRecord(
                arrival_s=self._arrivals.pop(request_id),
                first_token_s=first,
                finish_s=now if first is not None else None,
                worker_id=worker_id,
                prompt_tokens=request.num_prompt_tokens,
                cached_tokens=cached,
                output_tokens=request.num_output_tokens,
                prefill_worker_id=state.prefill_id if state and transferred else None,
                transfer_s=state.transfer_s if state else None,
            )
        )
        return replica

    def _first_token(self, request: Request, worker_id: str) -> RouterReplica:
        """Release what the guards hold until the first token; returns the replica."""
        replica = self._served_by[request.request_id][1]
        state = self._pairs.get(request.request_id)
        if state is None:
            replica.adjust(worker_id, 0, -request.num_prompt_tokens)
            return replica
        replica.adjust(worker_id, 0, -state.decode_tokens)
        state.decode_tokens = 0
        self._release_prefill(state, replica)  # at the latest with the first token
        return replica

    # -- prefill/decode fleets -------------------------------------------------------

    def _route_pair(self, spec: TraceRequest, request: Request, now: float, horizon: float) -> None:
        """The router's pair choice and guards, then the decode worker's reservation."""
        replica = self.replicas[0]
        query = route_query(spec, request, replica.policy.reads_prompt_blocks)
        loads = replica.snapshot().by_id
        decodes = [
            dataclasses.replace(loads[w], kv_free_fraction=self._headroom(w))
            for w in self._decode_ids
        ]
        prefills = [loads[w] for w in self._prefill_ids]
        decision = replica.policy.select_pair(query, decodes, prefills, now, self.config.pd)
        decode_id, prefill_id = decision.worker_id, decision.prefill_worker_id
        prompt = request.num_prompt_tokens
        state = _PairState(request, decode_id, prefill_id)
        self._pairs[request.request_id] = state
        self._arrivals[request.request_id] = now
        self._served_by[request.request_id] = (decode_id, replica)
        decode = self.workers[decode_id]
        if prefill_id is None:
            state.decode_tokens, state.prefill_released = prompt, True
            replica.adjust(decode_id, 1, prompt)
            self._run(decode, request, now, horizon)
            return
        replica.adjust(prefill_id, 1, prompt)
        replica.adjust(decode_id, 1, 0)
        scheduler = decode.scheduler
        holds = [*scheduler.running, *scheduler.waiting, *self._in_transfer[decode_id]]
        growth = growth_blocks(decode.kv_cache, holds)
        reservation = reserve(decode.kv_cache, request, growth, self.config.pd)
        if not reservation.remote:  # the decode worker prefills after all
            self._run(decode, request, now, horizon)
            return
        state.reservation = reservation
        self._in_transfer[decode_id].append(request)
        export = prefill_request(request, reservation, _NAMESPACE, BLOCK_TOKENS)
        self._exports[export.request_id] = state
        self._run(self.workers[prefill_id], export, now, horizon)

    def _headroom(self, worker_id: str) -> float:
        """Free and evictable blocks over all: what the decode worker's ``/load`` says."""
        return self.workers[worker_id].kv_cache.num_available_blocks / self.config.blocks_per_worker

    def _run(self, worker: SimWorker, request: Request, now: float, horizon: float) -> None:
        worker.add(request)
        if worker.busy_until is None:
            self._start(worker, now, horizon)

    def _export_ended(self, state: _PairState, export: Request, now: float, horizon: float) -> None:
        """The prefill worker is done: the transfer starts, or, if the prefill worker
        could not run it, the decode worker gives the lease up and prefills itself."""
        reservation = state.reservation
        assert reservation is not None
        decode = self.workers[state.decode_id]
        if export.num_output_tokens == 0:
            self._in_transfer[state.decode_id].remove(state.request)
            release(decode.kv_cache, state.request)
            self._release_prefill(state, self._served_by[state.request.request_id][1])
            self._run(decode, state.request, now, horizon)
            return
        state.prefill_cached = export.num_cached_tokens or 0
        missing = (reservation.num_blocks - reservation.cached_blocks) * BLOCK_TOKENS
        state.transfer_s = self._transfer.seconds(missing)
        end = now + state.transfer_s
        heapq.heappush(self._transfers, (end, self._order, state.request.request_id))
        self._order += 1

    def _transfer_ended(self, request_id: str, now: float, horizon: float) -> None:
        """The KV is installed: the decode worker answers (the prefill guard goes) and
        runs the request over its installed blocks."""
        state = self._pairs[request_id]
        decode = self.workers[state.decode_id]
        install(decode.kv_cache, state.request)
        self._in_transfer[state.decode_id].remove(state.request)
        self._release_prefill(state, self._served_by[request_id][1])
        self._leased[state.decode_id].append(state.request)
        self._run(decode, state.request, now, horizon)

    def _release_admitted_leases(self, worker: SimWorker) -> None:
        """A request that left the waiting queue pins its blocks itself: its lease goes."""
        leased = self._leased.get(worker.worker_id)
        if not leased:
            return
        waiting = [r for r in leased if r.status is RequestStatus.WAITING]
        for request in leased:
            if request.status is not RequestStatus.WAITING:
                release(worker.kv_cache, request)
        self._leased[worker.worker_id] = waiting

    def _release_prefill(self, state: _PairState, replica: RouterReplica) -> None:
        if state.prefill_id is not None and not state.prefill_released:
            state.prefill_released = True
            replica.adjust(state.prefill_id, -1, -state.request.num_prompt_tokens)


def simulate(
    trace: Sequence[TraceRequest],
    policy: str,
    config: SimConfig,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Replay ``trace`` on a fleet routed by ``policy``; see :data:`POLICIES`."""
    return Simulation(policy, config).run(trace, progress)
