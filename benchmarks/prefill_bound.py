"""A floor under any router's TTFT on a Mooncake-format trace: the prefill alone.

Each request is given the best cache any fleet could have (one cache of unlimited size
holding every block seen before) and an idle GPU, so its TTFT is at least the time to
prefill its uncached part, by kv_aware's own cost terms for the profile. The quantiles
of that floor bound every policy's: a TTFT target below the floor's p99 cannot be met
at any rate by routing alone.

Run: ``python benchmarks/prefill_bound.py TRACE [--profile llama3-8b-h100] [--slo 2.0]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.core.cost_model import profile
from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.sim.trace import BLOCK_TOKENS, load_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument("--slo", type=float, default=2.0, help="TTFT target in seconds")
    args = parser.parse_args()
    config = KvAwareConfig.from_cost_model(profile(args.profile))
    seen: set[int] = set()
    floors = []
    for request in load_trace(args.trace).requests:
        held = 0
        while held < len(request.hash_ids) and request.hash_ids[held] in seen:
            held += 1
        cached = min(held * BLOCK_TOKENS, request.input_tokens - 1)
        floors.append(config.prefill_s(request.input_tokens - cached, cached))
        seen.update(request.hash_ids)
    floors.sort()
    count = len(floors)
    over = sum(f > args.slo for f in floors) / count
    print(f"{args.trace.name}: {count} requests, prefill floor with an unlimited shared cache")
    for q in (0.5, 0.9, 0.99, 0.999):
        print(f"  p{q * 100:g}: {floors[min(count - 1, int(q * count))]:.3f} s")
    print(f"  over {args.slo:g} s: {over:.2%} of requests")


if __name__ == "__main__":
    main()
