"""Routing policies on a fleet of cost-model workers, measured through ``kvserve bench``.

Each policy gets a fresh fleet (same workers, same trace slice, same pacing, same cache
sizes): N ``kvserve worker --runner sim`` processes (real scheduler, KV cache, events and
HTTP; step times of Llama-3-8B on one H100; no weights) behind ``kvserve router --policy
P``, replayed with ``kvserve bench`` on a Mooncake conversation slice whose 512-token
blocks are shrunk to ``--block-tokens`` words. Policies run in rounds, the order rotated
each round, so a change in the (shared) machine's load does not favour one policy; the
figures are printed per round and as means, next to the slice's ceiling.

The setup is chosen so that the policies, not the box, decide the figures:

- the KV cache of every worker (``--num-blocks``) holds its share of the slice's working
  set, so hit rates are limited by routing rather than eviction;
- prompts are long enough (``--block-tokens``) that the modelled GPU time of a prefill
  is larger than the Python overhead of a request on a shared 2-core box;
- the workers' context is raised to ``--context`` (the cost-model runner reads no
  weights, so the tiny model's 4096 positions are no limit), so no request is refused;
- one engine step takes up to ``--max-num-batched-tokens`` tokens, as the simulator's.

Run: ``python benchmarks/fleet_kv_aware.py [--workers 8] [--requests 400]
[--time-scale 0.25] [--rounds 2] [--out runs/fleet-kv-aware]
[--policies cache_aware,kv_aware,kv_aware@8]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.bench.workloads import mooncake
from kvserve.bench.workloads.spec import data_dir
from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port
from kvserve.router.prompt_tokens import PromptHasher
from tests.support.processes import start_router

POLICIES = ("round_robin", "cache_aware", "kv_aware")
BLOCK_SIZE = 16


def make_model(context: int) -> Path:
    """The tiny model's config and tokenizer with a ``context``-token window."""
    from kvserve.engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="kvserve-fleet-")) / "tiny", "llama")
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = context
    config_path.write_text(json.dumps(config))
    return model_dir


def slice_ceiling(model_dir: Path, args: argparse.Namespace) -> float:
    """Hit rate with one infinite cache for the fleet: each request's longest prefix of
    full blocks that any earlier request computed, over its prompt tokens (the worker's
    tokenizer and block hashes, so the same units as the bench's hit rate)."""
    hasher = PromptHasher(model_dir)
    trace = data_dir() / "mooncake/conversation_trace.jsonl"
    workload = mooncake.load(
        trace, block_tokens=args.block_tokens, mode=args.mode, vocab=vocab_size(model_dir),
        limit=args.requests,
    )  # fmt: skip
    seen: set[int] = set()
    cached = total = 0
    for spec in workload.requests:
        prompt = spec.prompt if isinstance(spec.prompt, str) else list(spec.prompt or ())
        blocks = hasher.blocks({"model": str(model_dir), "prompt": prompt}, BLOCK_SIZE)
        assert blocks is not None
        held = next(
            (i for i, h in enumerate(blocks.reusable_hashes) if h not in seen),
            len(blocks.reusable_hashes),
        )
        cached += held * BLOCK_SIZE
        total += blocks.num_tokens
        seen.update(blocks.reusable_hashes)
    return cached / total


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def workload_keys(args: argparse.Namespace, model_dir: Path) -> str:
    """The bench's keys for the slice; token mode sends prompts as the model's token ids."""
    keys = f"block_tokens={args.block_tokens},max_tokens={args.max_tokens},mode={args.mode}"
    return keys + (f",vocab={vocab_size(model_dir)}" if args.mode == "tokens" else "")


def start_workers(model_dir: Path, args: argparse.Namespace) -> list[ServerProcess]:
    workers = []
    for _ in range(args.workers):
        port = free_port()
        command = [
            *KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port),
            "--runner", "sim", "--sim-profile", "llama3-8b-h100",
            "--block-size", str(BLOCK_SIZE), "--num-blocks", str(args.num_blocks),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--served-model-name", str(model_dir),
        ]  # fmt: skip
        workers.append(ServerProcess(command, f"http://127.0.0.1:{port}", name="sim-worker"))
    return [w.wait_healthy(180) for w in workers]


def router_args(policy: str) -> list[str]:
    """``kv_aware@W``: kv_aware with a recompute weight of ``W``; other names as they are."""
    name, _, weight = policy.partition("@")
    extra = ["--kv-aware-recompute-weight", weight] if weight else []
    return ["--policy", name, *extra]


def run_policy(policy: str, out: Path, args: argparse.Namespace, model_dir: Path) -> dict:
    """One bench run on a fresh fleet; its summary plus the router's decision counts."""
    workers = start_workers(model_dir, args)
    router = None
    try:
        router = start_router([w.url for w in workers], free_port(), *router_args(policy))
        workload = f"mooncake-conv:{workload_keys(args, model_dir)}"
        subprocess.run(
            [*KVSERVE_COMMAND, "bench", "--endpoint", router.url, "--workload", workload,
             "--max-requests", str(args.requests), "--time-scale", str(args.time_scale),
             "--ignore-eos", "--label", policy, "--out", str(out)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        router_metrics = scrape(router.url)
        worker_metrics = [scrape(w.url) for w in workers]
    finally:
        for server in [router, *workers]:
            if server is not None:
                server.stop()
    (out / "router_metrics.txt").write_text(router_metrics)
    summary = json.loads((out / "results.json").read_text())["summary"]
    summary["router_ttft_ms"] = 1e3 * mean_of([router_metrics], "kvserve_router_ttft_seconds")
    summary["worker_ttft_ms"] = 1e3 * mean_of(worker_metrics, "kvserve_time_to_first_token_seconds")
    return summary


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics") as response:
        return response.read().decode()


def mean_of(metrics: list[str], histogram: str) -> float:
    """A Prometheus histogram's mean over all its label sets and all ``metrics`` pages."""
    totals = {"_sum": 0.0, "_count": 0.0}
    for line in (line for page in metrics for line in page.splitlines()):
        for suffix in totals:
            if line.startswith(histogram + suffix):
                totals[suffix] += float(line.rsplit(" ", 1)[1])
    return totals["_sum"] / max(totals["_count"], 1.0)


def figures(summary: dict) -> dict[str, float]:
    ttft = summary["ttft_ms"]
    return {
        "hit rate": summary["prefix_hit_rate"],
        "TTFT p50 (ms)": ttft["p50"],
        "TTFT p90 (ms)": ttft["p90"],
        "TTFT p99 (ms)": ttft["p99"],
        "TTFT mean (ms)": ttft["mean"],
        "router TTFT mean (ms)": summary["router_ttft_ms"],
        "worker TTFT mean (ms)": summary["worker_ttft_ms"],
        "req/s": summary["request_throughput"],
        "output tok/s": summary["output_token_throughput"],
        "errors": summary["errors"],
    }


def print_table(title: str, rows: dict[str, dict[str, float]]) -> None:
    columns = list(next(iter(rows.values())))
    print(f"\n{title}\n| policy | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for policy, row in rows.items():
        cells = " | ".join(f"{v:.3f}" if k == "hit rate" else f"{v:.1f}" for k, v in row.items())
        print(f"| {policy} | {cells} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mode", choices=("text", "tokens"), default="text")
    parser.add_argument("--num-blocks", type=int, default=32768, help="per worker, 16 tokens each")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/fleet-kv-aware"))
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated; kv_aware@W: kv_aware with --kv-aware-recompute-weight W",
    )
    args = parser.parse_args()

    model_dir = make_model(args.context)
    print(f"slice ceiling (one infinite cache): hit rate {slice_ceiling(model_dir, args):.3f}")
    policies = args.policies.split(",")
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
    for round_index in range(args.rounds):
        shift = round_index % len(policies)
        for policy in policies[shift:] + policies[:shift]:
            out = args.out / f"round{round_index}" / policy
            runs[policy].append(figures(run_policy(policy, out, args, model_dir)))
        print_table(f"round {round_index}", {p: runs[p][-1] for p in policies if runs[p]})
    means = {
        p: {k: statistics.fmean(r[k] for r in rows) for k in rows[0]} for p, rows in runs.items()
    }
    print_table(f"mean of {args.rounds} rounds", means)
    last = [str(args.out / f"round{args.rounds - 1}" / p) for p in policies]
    subprocess.run(
        [*KVSERVE_COMMAND, "bench", "compare", *last, "--out", str(args.out)],
        check=True,
        stdout=subprocess.DEVNULL,
    )


if __name__ == "__main__":
    main()
