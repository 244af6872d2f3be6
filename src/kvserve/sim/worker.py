"""One simulated worker: the engine's scheduler and KV cache, with a cost model for a GPU.

A step is planned by the real :class:`~kvserve.core.scheduler.Scheduler` at its start
and takes effect at its end (``finish_step``), ``CostModel.step_time`` later, exactly as
an engine step schedules, runs the model, then advances. Generated tokens are a constant
id: only their number and their KV blocks matter here.

Decode runs are batched: when every running request is decoding and none waits, ``k``
decode steps are planned at once (each request gets ``k - 1`` placeholder tokens, so the
scheduler computes ``k`` tokens per request in one chunk) and timed with the closed-form
sum of ``k`` steps. ``k`` stops at the first request to finish, at the caller's horizon
(the next arrival, when routing could add work) and at the step's token budget, and a run
is only planned when the pool has the blocks for it, so no preemption can differ from
``k`` single steps. This turns the per-token Python loop into one call per run.

With a fleet's shared store (:mod:`kvserve.sim.shared_store`), a request waits for its
load from the store, beside the steps; a worker with nothing else to run waits for the
next load to end (an empty step, not counted as busy, that an arrival cuts short).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.core.cost_model import CostModel
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_events import KVEvent
from kvserve.core.request import Request
from kvserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.sim.shared_store import SimStore, StoreLoads

GENERATED_TOKEN = 0


@dataclass(slots=True)
class StepResult:
    first_tokens: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


class SimWorker:
    def __init__(
        self,
        worker_id: str,
        kv_cache: KVCacheManager,
        cost: CostModel,
        config: SchedulerConfig,
        store: SimStore | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.kv_cache = kv_cache
        self.cost = cost
        self._loads = StoreLoads(store, kv_cache) if store is not None else None
        self.scheduler = Scheduler(kv_cache, config, self._loads)
        self.busy_until: float | None = None  # end of the step in flight
        self.waiting_for_load = False  # the step in flight is only a wait for a load
        self.busy_s = 0.0
        self._plan: SchedulerOutput | None = None
        self._events_seen = 0

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def start_step(self, now: float, horizon: float) -> float | None:
        """Plan the next step; returns its duration, None if there is nothing to run."""
        if self._loads is not None:
            self._loads.now = now
        steps = self._decode_run_length(horizon - now)
        if steps > 1:
            for request in self.scheduler.running:
                request.token_ids.extend([GENERATED_TOKEN] * (steps - 1))
            contexts = [r.num_computed_tokens for r in self.scheduler.running]
            plan = self.scheduler.schedule()
            duration = self.cost.decode_run_time(contexts, steps)
        else:
            plan = self.scheduler.schedule()
            duration = self.cost.step_time((c.start, c.num_tokens) for c in plan.chunks)
            if self._loads is not None:
                self._loads.release_admitted()
        if not plan.chunks and not plan.finished_before_run:
            ready_at = self._loads.next_ready() if self._loads is not None else None
            if ready_at is None:
                return None
            self._plan, self.busy_until, self.waiting_for_load = plan, ready_at, True
            return ready_at - now
        self._plan = plan
        self.busy_until = now + duration
        self.busy_s += duration
        return duration

    def finish_step(self) -> StepResult:
        """Apply the planned step: computed tokens, sampled tokens, finished requests."""
        plan, self._plan, self.busy_until = self._plan, None, None
        assert plan is not None, "finish_step without a step in flight"
        self.waiting_for_load = False
        result = StepResult(finished=list(plan.finished_before_run))
        self.scheduler.advance(plan)
        for chunk in plan.chunks:
            if not chunk.completes_sequence:
                continue
            request = chunk.request
            request.token_ids.append(GENERATED_TOKEN)
            if request.num_output_tokens == 1:
                result.first_tokens.append(request)
            if request.num_output_tokens >= request.max_tokens:
                self.scheduler.finish(request, "length")
                result.finished.append(request)
        return result

    def stop_waiting(self) -> None:
        """End a wait for a load early (a request arrived: it may run now)."""
        assert self.waiting_for_load, "only a wait for a load is cut short"
        self.finish_step()

    def new_events(self) -> Sequence[KVEvent]:
        """Events this worker's cache emitted since the last call (for the router's index)."""
        events = self.kv_cache.events
        fresh = events.since(self._events_seen)
        self._events_seen = events.last_seq
        return fresh

    def _decode_run_length(self, gap_s: float) -> int:
        """How many decode steps to plan at once (1: a single ordinary step)."""
        scheduler = self.scheduler
        running = scheduler.running
        if scheduler.waiting or not running or not all(r.is_decoding for r in running):
            return 1
        steps = min(
            min(r.max_tokens - r.num_output_tokens for r in running),
            scheduler.config.max_num_batched_tokens // len(running),
        )
        if math.isfinite(gap_s):
            first_step = self.cost.decode_run_time((r.num_computed_tokens for r in running), 1)
            steps = min(steps, max(1, math.ceil(gap_s / first_step)))
        block_size = self.kv_cache.block_size
        needed = sum(
            -(-(r.num_computed_tokens + steps) // block_size)
            - -(-r.num_computed_tokens // block_size)
            for r in running
        )
        return steps if steps > 1 and needed <= self.kv_cache.num_available_blocks else 1
