"""Routing at fleet scale: decision time vs fleet size and prompt length, index memory.

Side by side in one run, each rule in a pass of its own over the same decisions (see
:func:`decision_times`), timed after ``--warmup`` untimed ones:

- ``cache_aware``: the policy over its approximate tree (the prompt as one character
  per block, as the simulator builds it);
- ``kv_aware``: the policy as it runs now (up to
  :data:`~kvserve.core.routing.kv_aware.SMALL_FLEET` workers every worker scored from
  one index walk; past it, holders from that walk and the lightest loads from
  :class:`~kvserve.core.routing.load_order.LoadOrder`);
- ``kv_aware exhaustive``: the reference rule, every worker matched and predicted
  (:func:`~kvserve.core.routing.kv_aware.lowest_ttft`): what kv_aware did before.

The fleet: each worker holds ``--blocks`` blocks of its own conversations; those of a
tenth of the workers start with a shared system prompt of 8 blocks; each request extends
one conversation (held by one worker, from its first block) by two blocks. Loads move as
a router's guards would: the chosen worker takes one request and its prefill, a random
worker releases one.
Decision time is CPU time (``time.thread_time_ns``) of ``select`` alone, given the loads
as the router gives them: a :class:`~kvserve.core.routing.pool_loads.PoolLoads` kept
between decisions. Before each decision ``--other-work-mib`` MiB are copied (8 by
default; :class:`OtherWork`): in a router a request's handling, not the last decision,
comes before a decision. Only decisions after ``--warmup`` untimed ones are timed, once
most workers have been chosen and hold what a policy makes on a worker's first choice.

``--extra-blocks N`` adds N blocks per worker that no request reads, to kv_aware's index
only (cache_aware's tree learns only the conversations): the decision at the index size
the issue names (10^5 blocks per worker) rather than ``--blocks``' hundred.

Index memory: bytes held per (block, holder) entry, measured with ``tracemalloc`` while
the index is built, for one holder per block and for blocks held by many workers.

With ``--sim-trace``: ``kvserve simulate``'s wall time for cache_aware and kv_aware on
that trace at ``--sim-workers`` workers, arrivals compressed ``--sim-speedup`` times (the
Mooncake trace at 10 workers ×1 scales to 1,000 workers ×100: the same load per worker).

Run: ``python benchmarks/routing_scale.py [--workers 10,100,1000,10000]
[--prompt-blocks 16,128] [--blocks 100] [--extra-blocks 0] [--decisions 300]
[--warmup N] [--other-work-mib 8] [--shared-store]
[--sim-trace $KVSERVE_DATA_DIR/mooncake/conversation_trace.jsonl --sim-workers 1000
--sim-speedup 100]``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvserve.core.cost_model import profile as cost_profile
from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.cache_aware import CacheAwareConfig
from kvserve.core.routing.kv_aware import KvAwareConfig, lowest_ttft
from kvserve.core.routing.kv_index import KVBlockIndex
from kvserve.core.routing.policies.cache_aware import CacheAwarePolicy
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.pool_loads import PoolLoads
from kvserve.core.routing.types import PromptBlocks, RouteQuery, WorkerLoad
from kvserve.sim.report import summarize
from kvserve.sim.simulator import SimConfig, simulate
from kvserve.sim.trace import load_trace

BLOCK_TOKENS = 16
SYSTEM_BLOCKS = 8
SYSTEM = list(range(1, SYSTEM_BLOCKS + 1))
FIRST_CHAR = 0x10000
EXTRA_FIRST_HASH = 10**12  # above every conversation's hashes


class Fleet:
    """Conversations per worker, as hashes; a query extends one of them."""

    def __init__(self, workers: int, blocks: int, prompt_blocks: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ids = [f"w{i}" for i in range(workers)]
        self.prompt_blocks = prompt_blocks
        self.pool = PoolLoads(WorkerLoad(w) for w in self.ids)  # as the router keeps them
        self.system_holders = set(self.ids[:: max(1, workers // 10)])
        # each worker: conversations of prompt_blocks - 2 blocks, the system prompt's first
        # on its holders (a chained hash: a conversation held is held from its first block)
        own_blocks = max(1, prompt_blocks - 2)
        self.conversations: dict[str, list[list[int]]] = {}
        next_hash = 1000
        for w in self.ids:
            shared = SYSTEM if w in self.system_holders else []
            per_conversation = max(1, own_blocks - len(shared))
            chains = []
            for _ in range(max(1, blocks // per_conversation)):
                chains.append([*shared, *range(next_hash, next_hash + per_conversation)])
                next_hash += per_conversation
            self.conversations[w] = chains
        self.next_hash = next_hash

    def fill(
        self, policy: KvAwarePolicy, extra_blocks: int = 0, shared_store: bool = False
    ) -> None:
        """The workers' blocks into kv_aware's index, each worker with ``extra_blocks``
        more that no request reads (the index's size, not the prompts'); with a
        ``shared_store``, every worker loads from one store, to which each wrote its
        conversations through."""
        for n, w in enumerate(self.ids):
            stored = [h for chain in self.conversations[w] for h in chain]
            policy.observe_events(w, [KVEvent(1, "stored", "device", tuple(stored), None)])
            if shared_store:
                policy.observe_store(w, "store")
                policy.observe_events(w, [KVEvent(3, "stored", "storage", tuple(stored), None)])
            if extra_blocks:
                first = EXTRA_FIRST_HASH + n * extra_blocks
                extra = tuple(range(first, first + extra_blocks))
                policy.observe_events(w, [KVEvent(2, "stored", "device", extra, None)])
        for load in self.pool:
            policy.observe_load(load)

    def query(self) -> RouteQuery:
        owner = self.rng.choice(self.ids)
        chain = self.rng.choice(self.conversations[owner])
        fresh = list(range(self.next_hash, self.next_hash + 2))
        self.next_hash += 2
        hashes = [*chain, *fresh][: self.prompt_blocks]
        tokens = len(hashes) * BLOCK_TOKENS + 5
        return RouteQuery(
            text="".join(chr(FIRST_CHAR + h % 0xE0000) for h in hashes),
            model="m",
            prefill_tokens=tokens,
            blocks=PromptBlocks(tokens, hashes, BLOCK_TOKENS),
        )

    def move_loads(self, chosen: str, tokens: int, observe: Callable[[WorkerLoad], None]) -> None:
        load = self.pool.by_id[chosen]
        self._moved(
            WorkerLoad(chosen, load.in_flight_requests + 1, load.in_flight_prefill_tokens + tokens),
            observe,
        )
        done = self.rng.choice(self.ids)
        load = self.pool.by_id[done]
        if load.in_flight_requests:
            self._moved(WorkerLoad(done, load.in_flight_requests - 1, 0), observe)

    def _moved(self, load: WorkerLoad, observe: Callable[[WorkerLoad], None]) -> None:
        self.pool.replace(load)
        observe(load)


RULES = ("kv_aware", "cache_aware", "kv_aware exhaustive")


def default_warmup(workers: int) -> int:
    """Untimed decisions before the timed ones: enough that most workers have been
    chosen once (twice the fleet: 86 % of it) and hold the state a policy makes on a
    worker's first choice, as a router that has run for a while does."""
    return max(500, 2 * workers)


class OtherWork:
    """What a router does between two decisions (a request parsed, tokenized, proxied),
    standing in as a copy of ``mib`` MiB: the next decision finds the caches as a
    request's handling leaves them, not as the last decision did. 0: decisions back to
    back, each finding the last one's data still cached (a rule whose data fits in the
    caches then looks faster than it is in a router)."""

    def __init__(self, mib: float) -> None:
        size = int(mib * 2**20)
        self._source = bytearray(b"\x01") * size  # not zeros: those read one shared page
        self._target = bytearray(size)

    def __call__(self) -> None:
        if self._source:
            self._target[:] = self._source


def decision_times(
    workers: int,
    prompt_blocks: int,
    blocks: int,
    decisions: int,
    seed: int,
    extra_blocks: int = 0,
    warmup: int | None = None,
    other_work: OtherWork | None = None,
    shared_store: bool = False,
) -> dict[str, list[float]]:
    """Microseconds per decision for each rule, each rule in a pass of its own over the
    same decisions, after ``warmup`` untimed ones (:func:`default_warmup` if None),
    ``other_work`` done before each (none if None).

    kv_aware's choices move the loads in every pass (its own pass records them, the
    cache_aware pass replays them, the exhaustive pass makes them again), so every rule
    decides on the same states. Apart, because a rule alternating with another is
    charged for the other's work: the collections the other's garbage starts land in
    either's decisions, and each evicts the other's data from the caches (at 1,000
    workers, 128-block prompts: no collection in 2,000 kv_aware decisions alone, 6 when
    alternating with cache_aware, whose tree grows with every request)."""
    warmup = default_warmup(workers) if warmup is None else warmup
    between = other_work or OtherWork(0)
    choices: list[str] = []
    times: dict[str, list[float]] = {}
    for rule in RULES:
        gc.collect()  # the last pass's fleet gone before this one's is built (10^8 entries)
        fleet = Fleet(workers, blocks, prompt_blocks, seed)
        times[rule] = _pass(
            rule, fleet, decisions, warmup, extra_blocks, choices, between, shared_store
        )
    return times


Decide = Callable[[int, RouteQuery, PoolLoads, float], tuple[str, float]]


def _pass(
    rule: str,
    fleet: Fleet,
    decisions: int,
    warmup: int,
    extra_blocks: int,
    choices: list[str],
    other_work: Callable[[], None],
    shared_store: bool = False,
) -> list[float]:
    """``rule``'s CPU µs on each decision after the first ``warmup``, ``other_work``
    done before each. kv_aware's pass appends its choices to ``choices``; the others
    move the loads by them."""
    decide, observe = _rule(rule, fleet, warmup, extra_blocks, choices, shared_store)
    times: list[float] = []
    gc.collect()
    for n in range(warmup + decisions):
        now = n * 0.01
        query = fleet.query()
        other_work()
        chosen, spent = decide(n, query, fleet.pool, now)
        if n >= warmup:
            times.append(spent)
        fleet.move_loads(chosen, query.prefill_tokens, observe)
    return times


def _rule(
    rule: str,
    fleet: Fleet,
    warmup: int,
    extra_blocks: int,
    choices: list[str],
    shared_store: bool = False,
) -> tuple[Decide, Callable[[WorkerLoad], None]]:
    """How ``rule`` decides the ``n``-th request (the choice that moves the loads, and
    the rule's CPU µs), and what is told of a change of load."""
    if rule == "cache_aware":  # no kv_aware state, nor its garbage, in this pass
        cache = _learnt_cache_aware(fleet)

        def replayed(n: int, query: RouteQuery, loads: PoolLoads, now: float) -> tuple[str, float]:
            return choices[n], _timed(_select, cache, query, loads, now)[1]

        return replayed, _unread
    kv = KvAwarePolicy(KvAwareConfig())
    fleet.fill(kv, extra_blocks, shared_store)
    if rule == "kv_aware":

        def recorded(n: int, query: RouteQuery, loads: PoolLoads, now: float) -> tuple[str, float]:
            chosen, spent = _timed(_select, kv, query, loads, now)
            choices.append(chosen)
            return chosen, spent

        return recorded, kv.observe_load

    def reference(n: int, query: RouteQuery, loads: PoolLoads, now: float) -> tuple[str, float]:
        """The reference rule, timed (not in the warm-up), then kv_aware's choice."""
        spent = _timed(_exhaustive, kv, query, loads, now)[1] if n >= warmup else 0.0
        chosen = _select(kv, query, loads, now)
        assert chosen == choices[n], "the exhaustive pass left kv_aware's decisions"
        return chosen, spent

    return reference, kv.observe_load


def _unread(_: WorkerLoad) -> None:
    """A change of load, which cache_aware is not told of."""


def _learnt_cache_aware(fleet: Fleet) -> CacheAwarePolicy:
    """cache_aware whose tree learnt each worker's conversations as routed there."""
    cache = CacheAwarePolicy(CacheAwareConfig(), 0.0)
    for w in fleet.ids:
        for chain in fleet.conversations[w]:
            cache.index.tree("regular", "m").insert(
                "".join(chr(FIRST_CHAR + h % 0xE0000) for h in chain), w, 0.0
            )
    return cache


def _timed(rule: Callable[..., str], *args: Any) -> tuple[str, float]:
    """``rule(*args)``'s choice and its CPU time in µs."""
    started = time.thread_time_ns()
    chosen = rule(*args)
    return chosen, (time.thread_time_ns() - started) / 1e3


def _select(policy: Policy, query: RouteQuery, loads: Sequence[WorkerLoad], now: float) -> str:
    return policy.select(query, loads, now).worker_id


def _exhaustive(
    policy: KvAwarePolicy, query: RouteQuery, loads: Sequence[WorkerLoad], now: float
) -> str:
    """The reference rule over the same index and queue; it records nothing."""
    assert query.blocks is not None
    hashes, routing = query.blocks.reusable_hashes, policy.routing
    ids = [w.worker_id for w in loads]
    return lowest_ttft(
        loads,
        routing.index.match(hashes, ids, now),
        {w: routing.queue.queued_s(w, now) for w in ids},
        query.blocks.num_tokens,
        BLOCK_TOKENS,
        hashes[-1],
        routing.config,
    ).worker_id


def index_bytes_per_entry(workers: int, blocks: int, holders: int) -> float:
    """Bytes the index holds per (block, holder): ``blocks`` blocks per group of
    ``holders`` workers, every worker of a group holding all its group's blocks."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = KVBlockIndex()
    next_hash = 0
    for group in range(0, workers, holders):
        hashes = tuple(range(next_hash, next_hash + blocks))
        next_hash += blocks
        for w in range(group, min(group + holders, workers)):
            index.apply(f"w{w}", KVEvent(1, "stored", "device", hashes, None))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    entries = sum(index.num_blocks(f"w{w}") for w in range(workers))
    return used / entries


def simulator_wall(trace: Path, workers: int, speedup: float) -> None:
    loaded = load_trace(trace, speedup=speedup)
    cost = cost_profile("llama3-8b-h100")
    config = SimConfig(
        num_workers=workers,
        cache_tokens=3_000_000,
        cost=cost,
        kv_aware=KvAwareConfig.from_cost_model(cost),
    )
    print(f"\n## simulator, {workers} workers, {loaded.name} x{speedup:g}\n")
    print("| policy | wall (s) | hit rate | TTFT p50 (s) | p99 (s) |")
    print("|---|---:|---:|---:|---:|")
    for name in ("cache_aware", "kv_aware"):
        summary = summarize(simulate(loaded.requests, name, config))
        print(
            f"| {name} | {summary.sim_wall_s:.1f} | {summary.hit_rate:.3f} | "
            f"{summary.ttft_p50_s:.3f} | {summary.ttft_p99_s:.3f} |",
            flush=True,
        )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="10,100,1000,10000")
    parser.add_argument("--prompt-blocks", default="16,128")
    parser.add_argument("--blocks", type=int, default=100, help="indexed blocks per worker")
    parser.add_argument(
        "--extra-blocks",
        type=int,
        default=0,
        help="more indexed blocks per worker, read by no request (kv_aware's index only)",
    )
    parser.add_argument("--decisions", type=int, default=300)
    parser.add_argument(
        "--other-work-mib",
        type=float,
        default=8.0,
        help="MiB copied before each decision, for a request's handling (0: none)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        help="untimed decisions before the timed ones (default: twice the fleet, 500 at least)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shared-store",
        action="store_true",
        help="every worker loads from one KV store its conversations were written to",
    )
    parser.add_argument("--sim-trace", type=Path)
    parser.add_argument("--sim-workers", type=int, default=1000)
    parser.add_argument("--sim-speedup", type=float, default=100.0)
    args = parser.parse_args()
    if args.sim_trace is not None:
        simulator_wall(args.sim_trace, args.sim_workers, args.sim_speedup)
        return
    other_work = OtherWork(args.other_work_mib)
    store = ", the fleet sharing one KV store" if args.shared_store else ""
    print(f"## decision time, µs of CPU (p50 / p99), {args.other_work_mib:g} MiB between{store}\n")
    print("| workers | prompt blocks | cache_aware | kv_aware | kv_aware exhaustive |")
    print("|---:|---:|---:|---:|---:|")
    for workers in (int(w) for w in args.workers.split(",")):
        for prompt_blocks in (int(p) for p in args.prompt_blocks.split(",")):
            times = decision_times(
                workers,
                prompt_blocks,
                args.blocks,
                args.decisions,
                args.seed,
                args.extra_blocks,
                args.warmup,
                other_work,
                args.shared_store,
            )
            cells = [
                f"{statistics.median(t):.0f} / {_percentile(t, 0.99):.0f}"
                for t in (times["cache_aware"], times["kv_aware"], times["kv_aware exhaustive"])
            ]
            print(f"| {workers} | {prompt_blocks} | {' | '.join(cells)} |", flush=True)
    print("\n## kv_aware index memory, bytes per (block, holder)\n")
    print("| workers | blocks per group | holders per block | bytes per entry |")
    print("|---:|---:|---:|---:|")
    for workers, holders in ((10, 1), (1000, 1), (1000, 10), (1000, 100)):
        blocks = 20_000 // holders if holders > 1 else 200
        per_entry = index_bytes_per_entry(workers, blocks, holders)
        print(f"| {workers} | {blocks} | {holders} | {per_entry:.0f} |", flush=True)


if __name__ == "__main__":
    main()
