"""The real router's CPU per routing decision, by part, at 10 and 1,000 workers.

:meth:`kvserve.router.proxy.Proxy._select` on the router's own objects (registry, load
tracker wired to the policy as the app wires it, metrics), no network: what the event
loop spends choosing a worker for one request. The parts, timed on the same requests:

- ``accepting``: the registry's list of the pool's workers that take traffic;
- ``loads``: the loads the policy is given: kept per pool between requests (``kept``,
  the router's way since it keeps them) or the tracker's load of each worker listed per
  request (``listed``, as before; with ``--processes N`` it still does);
- ``policy``: ``policy.select`` on that list;
- ``_select``: the whole of it (the three above, the decision's metrics, the lookup of
  the chosen worker).

The fleet and requests are ``routing_scale.py``'s (each worker holds ``--blocks``
blocks of its own conversations, a tenth hold a shared system prompt); the chosen
worker keeps a guard until a random later decision releases one, as requests would.
Rules alternate per request so that machine noise hits all alike.

Run: ``python benchmarks/router_select.py [--workers 10,1000] [--decisions 300]
[--loads kept,listed]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence

from kvserve.core.routing.types import WorkerLoad
from kvserve.router.app import Router
from kvserve.router.config import RouterConfig
from kvserve.router.load_guard import LoadGuard
from kvserve.router.metrics import RouterMetrics
from kvserve.router.proxy import Proxy
from kvserve.router.worker_registry import Worker
from routing_scale import Fleet

PARTS = ("accepting", "loads", "policy", "_select")


class RouterUnderTest:
    """One policy's router objects over ``workers`` registered workers."""

    def __init__(
        self, policy_name: str, workers: int, blocks: int, prompt_blocks: int, keep: bool
    ) -> None:
        self.fleet = Fleet(workers, blocks, prompt_blocks, seed=0)
        config = RouterConfig(
            worker_urls=tuple(f"http://w{i}.test" for i in range(workers)), policy=policy_name
        )
        router = Router(config)  # its registry, tracker, policy and kept loads, wired
        for worker in router.registry.all():
            worker.healthy = True
        self.registry, self.tracker, self.policy = router.registry, router.tracker, router.policy
        self.kept = router.kept_loads if keep else None
        self.now = 0.0
        self.proxy = Proxy(
            config,
            self.registry,
            self.tracker,
            self.policy,
            RouterMetrics(),
            None,
            self.clock,
            kept_loads=self.kept,
        )
        if self.policy.observes_kv_events:
            self.fleet.fill(self.policy)  # type: ignore[arg-type]
        self.guards: list[LoadGuard] = []
        self.rng = random.Random(1)

    def clock(self) -> float:
        return self.now

    def loads(self, pool: str, workers: Sequence[Worker]) -> Sequence[WorkerLoad]:
        if self.kept is not None:
            return self.kept.of(pool, workers)
        return [self.tracker.load(w.worker_id) for w in workers]

    def decide(self, times: dict[str, list[float]]) -> None:
        """One request: each part timed alone, then the whole; then loads move."""
        query = self.fleet.query()
        parts: list[tuple[str, Callable[[], object]]] = [
            ("accepting", lambda: self.registry.accepting(self.now, query.pool)),
            ("_select", lambda: self.proxy._select(query, set())),
        ]
        workers = self.registry.accepting(self.now, query.pool)
        loads = self.loads(query.pool, workers)
        parts.insert(1, ("loads", lambda: self.loads(query.pool, workers)))
        parts.insert(2, ("policy", lambda: self.policy.select(query, loads, self.now)))
        chosen = ""
        for name, part in parts:
            started = time.thread_time_ns()
            result = part()
            times[name].append((time.thread_time_ns() - started) / 1e3)
            if name == "_select":
                assert result is not None
                chosen = result[0].worker_id
        self.guards.append(self.tracker.acquire(chosen, query.prefill_tokens))
        if self.guards and self.rng.random() < 0.9:
            self.guards.pop(self.rng.randrange(len(self.guards))).release()
        self.now += 0.01


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="10,1000")
    parser.add_argument("--policies", default="cache_aware,kv_aware")
    parser.add_argument("--blocks", type=int, default=100)
    parser.add_argument("--prompt-blocks", type=int, default=16)
    parser.add_argument("--decisions", type=int, default=300)
    parser.add_argument("--loads", default="kept,listed", help="kept, listed or both")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()}")
    print("\n## router CPU per decision, µs (p50 / p99)\n")
    print(f"| workers | policy | {' | '.join(PARTS)} |")
    print("|---:|---|" + "---:|" * len(PARTS))
    for workers in (int(w) for w in args.workers.split(",")):
        routers = {
            f"{name} ({mode})": RouterUnderTest(
                name, workers, args.blocks, args.prompt_blocks, mode == "kept"
            )
            for name in args.policies.split(",")
            for mode in args.loads.split(",")
        }
        times = {name: {part: [] for part in PARTS} for name in routers}
        gc.collect()
        for n in range(args.decisions):
            order = list(routers.items())
            for name, router in order if n % 2 else reversed(order):
                router.decide(times[name])
        for name, parts in times.items():
            cells = [
                f"{statistics.median(v):.0f} / {sorted(v)[int(len(v) * 0.99)]:.0f}"
                for v in parts.values()
            ]
            print(f"| {workers} | {name} | {' | '.join(cells)} |", flush=True)
    print(f"\nload average {os.getloadavg()}")


if __name__ == "__main__":
    main()
