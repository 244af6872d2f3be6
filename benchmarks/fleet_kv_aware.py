"""Routing policies on a fleet of cost-model workers, measured through ``kvserve bench``.

Each policy gets a fresh fleet (same workers, same trace slice, same pacing): N
``kvserve worker --runner sim`` processes (real scheduler, KV cache, events and HTTP;
step times of Llama-3-8B on one H100; no weights) behind ``kvserve router --policy P``,
replayed with ``kvserve bench`` on a Mooncake conversation slice whose 512-token blocks
are shrunk to ``--block-tokens`` words (the tiny model's context is 4096). The policies
run one after another in one invocation and are printed side by side
(``kvserve bench compare``).

Run: ``python benchmarks/fleet_kv_aware.py [--workers 8] [--requests 400]
[--time-scale 0.25] [--out runs/fleet-kv-aware]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess, free_port
from tests.support.processes import start_router

POLICIES = ("round_robin", "cache_aware", "kv_aware")


def start_workers(model_dir: Path, count: int, num_blocks: int) -> list[ServerProcess]:
    workers = []
    for _ in range(count):
        port = free_port()
        args = [
            *KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port),
            "--runner", "sim", "--sim-profile", "llama3-8b-h100", "--block-size", "16",
            "--num-blocks", str(num_blocks), "--served-model-name", str(model_dir),
        ]  # fmt: skip
        workers.append(ServerProcess(args, f"http://127.0.0.1:{port}", name="sim-worker"))
    return [w.wait_healthy(120) for w in workers]


def run_policy(policy: str, args: argparse.Namespace, model_dir: Path) -> Path:
    workers = start_workers(model_dir, args.workers, args.num_blocks)
    router = None
    try:
        router = start_router([w.url for w in workers], free_port(), "--policy", policy)
        out = args.out / policy
        workload = f"mooncake-conv:block_tokens={args.block_tokens},max_tokens={args.max_tokens}"
        subprocess.run(
            [*KVSERVE_COMMAND, "bench", "--endpoint", router.url, "--workload", workload,
             "--max-requests", str(args.requests), "--time-scale", str(args.time_scale),
             "--ignore-eos", "--label", policy, "--out", str(out)],
            check=True,
        )  # fmt: skip
        return out
    finally:
        for server in [router, *workers]:
            if server is not None:
                server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=1024, help="per worker, 16 tokens each")
    parser.add_argument("--out", type=Path, default=Path("runs/fleet-kv-aware"))
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    args = parser.parse_args()

    from kvserve.engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="kvserve-fleet-")) / "tiny", "llama")
    policies = args.policies.split(",")
    runs = [run_policy(policy, args, model_dir) for policy in policies]
    subprocess.run(
        [*KVSERVE_COMMAND, "bench", "compare", *map(str, runs), "--out", str(args.out)], check=True
    )
    summaries = {
        p: json.loads((r / "results.json").read_text())["summary"]
        for p, r in zip(policies, runs, strict=True)
    }
    base = summaries[policies[0]]
    for policy, s in summaries.items():
        ttft = s["ttft_ms"]
        print(
            f"{policy:12s} hit rate {s['prefix_hit_rate']:.3f}  TTFT p50 {ttft['p50']:.1f} ms"
            f" (x{ttft['p50'] / base['ttft_ms']['p50']:.2f} of {policies[0]})"
            f"  p90 {ttft['p90']:.1f} ms  errors {s['errors']}"
        )


if __name__ == "__main__":
    main()
