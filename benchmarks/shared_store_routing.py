"""Routing over a fleet that shares one KV store, in the simulator: what crediting the
store's blocks to every worker that can load them is worth.

Each cell runs the same trace on the same fleet (``--workers`` × ``--cache-tokens``,
Llama-3-8B on H100 step times) four ways, side by side:

- ``cache_aware``, no store; ``kv_aware``, no store;
- ``cache_aware`` with the store (it reads no KV events: the store helps it only where a
  worker's own lookup finds blocks there);
- ``kv_aware`` with the store, every worker told it loads from it (``observe_store``, as
  the router is told by each worker's ``/kv/snapshot``): a block any worker wrote counts
  for all;
- ``kv_aware`` with the store, each block credited to its writer alone (every worker
  then told it shares no store): the router before it learnt of shared stores.

Run: ``python benchmarks/make_routing_traces.py /tmp/rt`` then
``python benchmarks/shared_store_routing.py --trace /tmp/rt/agentic_sessions.jsonl
[--workers 10] [--cache-tokens 200000] [--store-tokens 20000000] [--speedups 2,4]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.core.cost_model import profile
from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.sim.report import PolicySummary, summarize
from kvserve.sim.simulator import SimConfig, Simulation
from kvserve.sim.trace import load_trace

WAYS = (
    ("cache_aware", False, True),
    ("kv_aware", False, True),
    ("cache_aware", True, True),
    ("kv_aware", True, True),
    ("kv_aware", True, False),
)


def run(
    trace: Path, speedup: float, policy: str, config: SimConfig, credited: bool
) -> PolicySummary:
    simulation = Simulation(policy, config)
    if not credited:  # what a router unaware of shared stores knows: each its own writes
        for replica in simulation.replicas:
            for worker_id in simulation.workers:
                replica.policy.observe_store(worker_id, None)
    return summarize(simulation.run(load_trace(trace, speedup=speedup).requests))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--cache-tokens", type=int, default=200_000)
    parser.add_argument("--store-tokens", type=int, default=20_000_000)
    parser.add_argument("--speedups", default="2,4")
    args = parser.parse_args()
    cost = profile("llama3-8b-h100")
    kv_aware = KvAwareConfig.from_cost_model(cost)
    print(
        f"# {args.trace.name}, {args.workers} workers x {args.cache_tokens:,} cache tokens, "
        f"store {args.store_tokens:,} tokens at {kv_aware.storage_load_token_s * 1e6:g} "
        "µs/token\n"
    )
    print(
        "| arrivals | policy | store | credited to | hit rate | from store | TTFT mean | p50 ",
        end="",
    )
    print("| p99 |")
    print("|---:|---|---|---|---:|---:|---:|---:|---:|")
    for speedup in (float(s) for s in args.speedups.split(",")):
        for policy, with_store, credited in WAYS:
            config = SimConfig(
                args.workers,
                args.cache_tokens,
                cost,
                kv_aware=kv_aware,
                store_tokens=args.store_tokens if with_store else 0,
                store_load_token_s=kv_aware.storage_load_token_s,
            )
            s = run(args.trace, speedup, policy, config, credited)
            store = "yes" if with_store else "no"
            whom = (
                ""
                if not with_store or policy != "kv_aware"
                else ("every member" if credited else "its writer")
            )
            loaded = "" if s.store_hit_rate is None else f"{s.store_hit_rate:.3f}"
            print(
                f"| x{speedup:g} | {policy} | {store} | {whom} | {s.hit_rate:.3f} | {loaded} "
                f"| {s.ttft_mean_s:.3f} | {s.ttft_p50_s:.3f} | {s.ttft_p99_s:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
