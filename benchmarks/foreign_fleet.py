"""A fleet of real vLLM servers (CPU build, .venv-vllm) behind kvserve's router
(``kv_aware``, every worker's cache learned from its ZMQ KV events) and behind SGLang's
router (``sglang_router.launch_router --policy cache_aware``, an approximate tree of its
own routing history), measured with ``kvserve bench`` on the same workloads, the same
servers and the same machine, in one run.

Every run gets a fresh router and empty vLLM prefix caches (``POST /reset_prefix_cache``,
which vLLM serves with ``VLLM_SERVER_DEV_MODE=1``; it publishes ``AllBlocksCleared`` with
its next step, which a two-token prompt then runs), and the order of the routers
alternates between rounds, so that neither inherits warm caches or a quieter machine. Hit
rate is vLLM's own ``usage.prompt_tokens_details.cached_tokens`` over prompt tokens
(``--enable-prompt-tokens-details``).

Each vLLM server runs on a CPU of its own (``--pin-workers``, as each GPU worker has its
own device; otherwise both engines' steps queue on every core and placement hardly
matters) in a single process (vLLM's default layout busy-polls between its processes,
which on a small machine stalls everything for up to a second; docs/benchmarks.md).
Load is a closed loop of ``--concurrency`` users, or open-loop Poisson arrivals at
``--rate`` requests per second, as traffic reaches a fleet (a closed loop starts with a
synchronized burst on empty caches whose cold prefills set p99 for any router).

``chat-sessions`` are conversations of four turns after one system prompt, the traffic
of a chat application; with ``--vllm-kv-blocks`` each server's cache holds a few
conversations, so a router that sends them all to one server makes it evict them, as a
GPU server's full cache does.

The model is a random-weight qwen3 (head_dim 32, as vLLM's CPU attention needs) wide
enough that a prefill costs real time on a CPU, so that reusing a prefix shows in TTFT.

``--routers`` adds ``kvserve-cache_aware`` (kvserve's router running sglang-router's
policy), which separates what the router process costs from what the policy decides.

Run: ``python benchmarks/foreign_fleet.py [--requests 48] [--rounds 1]
[--concurrency 4 | --rate 8] [--routers kvserve-kv_aware sglang-cache_aware
kvserve-cache_aware] [--recompute-weights 0 9] [--workloads shared-prefix mooncake-conv
hot-prefix system-prompt chat-sessions] [--vllm-kv-blocks 72] [--out runs/foreign-fleet]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port
from tests.support.processes import start_router
from tests.support.vllm_server import BLOCK_SIZE, VllmServer

KV_AWARE = "kvserve-kv_aware"
ROUTERS = (KV_AWARE, "sglang-cache_aware", "kvserve-cache_aware")
CHAT_TURNS = 4
WORKLOADS = {
    "shared-prefix": "shared-prefix:n_prefixes=6,prefix_len=384,suffix_len=24,max_tokens=8",
    "mooncake-conv": "mooncake-conv:block_tokens=10,max_tokens=8",
    "hot-prefix": (
        "shared-prefix:n_prefixes=8,prefix_len=384,suffix_len=24,max_tokens=8,popularity_skew=1.2"
    ),
    # one system prompt before every question: its holder is every request's best match
    "system-prompt": "shared-prefix:n_prefixes=1,prefix_len=384,suffix_len=96,max_tokens=8",
    # chats after one system prompt; --vllm-kv-blocks makes the caches fill
    "chat-sessions": (
        f"multi-turn:turns={CHAT_TURNS},systems=1,system_len=128,user_len=32,max_tokens=8"
    ),
}


def make_model() -> Path:
    from kvserve.engine.tiny_model import TinyShape, make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="kvserve-foreign-"))
    shape = TinyShape(
        hidden_size=256,
        intermediate_size=768,
        num_heads=8,
        num_kv_heads=4,
        num_layers=4,
        head_dim=32,
    )
    return make_tiny_model(root / "qwen3", "qwen3", shape=shape)


def start_sglang_router(workers: list[VllmServer]) -> ServerProcess:
    port = free_port()
    args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--policy", "cache_aware", "--log-level", "warn"]
    args += ["--worker-urls", *[w.url for w in workers]]
    return ServerProcess(args, f"http://127.0.0.1:{port}", name="sglang-router").wait_healthy(60)


def start_kvserve_router(
    workers: list[VllmServer],
    model_dir: Path,
    prefill_token_s: float,
    decode_s: float,
    recompute_weight: float | None,
) -> ServerProcess:
    """kv_aware with this machine's costs, both measured on the same servers: seconds per
    prompt token, and what a running sequence adds to a new prompt's TTFT; its weights
    are the router's defaults unless a recompute weight is given."""
    weight = (
        [] if recompute_weight is None else ["--kv-aware-recompute-weight", str(recompute_weight)]
    )
    router = start_router(
        [w.url for w in workers], free_port(), "--policy", "kv_aware",
        "--tokenizer", str(model_dir), "--kv-events", *[w.kv_events() for w in workers],
        "--kv-block-size", str(BLOCK_SIZE), "--kv-prefill-token-s", str(prefill_token_s),
        "--kv-decode-request-s", str(decode_s), *weight,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not all("kv_events_stream" in w for w in _workers(router)):  # followers started
        assert time.monotonic() < deadline, "the router never followed its workers' events"
        time.sleep(0.1)
    return router


def vllm_counters(workers: list[VllmServer]) -> list[dict[str, float]]:
    """Each server's own count of finished requests and of preemptions (a sequence
    evicted for room and recomputed later): which server a router used, whatever the
    router tells its clients (sglang-router names none)."""
    counters = []
    for worker in workers:
        read = worker.counters("vllm:request_success_total", "vllm:num_preemptions_total")
        counters.append(
            {
                "requests": read["vllm:request_success_total"],
                "preemptions": read["vllm:num_preemptions_total"],
            }
        )
    return counters


def _workers(router: ServerProcess) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{router.url}/workers", timeout=10) as response:
        workers: list[dict[str, Any]] = json.loads(response.read())["workers"]
    return workers


def _cold_ttft_s(worker: VllmServer, model_dir: Path, tokens: list[int]) -> float:
    body = json.dumps({"model": str(model_dir), "prompt": tokens, "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"{worker.url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - started


def prefill_token_s(worker: VllmServer, model_dir: Path) -> float:
    """Seconds per prompt token on this machine: the slope between cold prompts of 128
    and 1,536 tokens (best of three each, fresh tokens every time)."""
    times = {}
    for length in (128, 1536):
        times[length] = min(
            _cold_ttft_s(
                worker, model_dir, [(7 * i + 13 * k + length) % 900 + 50 for i in range(length)]
            )
            for k in range(3)
        )
    return (times[1536] - times[128]) / (1536 - 128)


def decode_request_s(worker: VllmServer, model_dir: Path, running: int = 4) -> float:
    """What one running sequence adds to a new prompt's TTFT on this machine, as kv_aware's
    ``decode_request_s`` means it: a cold 384-token prompt's TTFT beside ``running``
    sequences decoding, minus its TTFT on an idle server, per sequence (best of three
    each). vLLM batches the new prefill with the running decodes, so on a CPU every step
    it shares with them is longer, and it waits for the step in progress."""

    def prompt(k: int) -> list[int]:
        return [(11 * i + 17 * k + 5) % 900 + 50 for i in range(384)]

    _cold_ttft_s(worker, model_dir, prompt(99))  # the first of a length runs slower
    idle = min(_cold_ttft_s(worker, model_dir, prompt(k)) for k in range(3))
    # 4 x 483 tokens fit the smallest cache --vllm-kv-blocks allows beside the measured
    # prompt (a sequence preempted for room would measure preemption instead), and last
    # past the measurement.
    body = {"model": str(model_dir), "prompt": [60, 61, 62], "max_tokens": 480, "ignore_eos": True}
    stop = threading.Event()

    def decode_forever() -> None:
        while not stop.is_set():
            request = urllib.request.Request(
                f"{worker.url}/v1/completions", json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=600) as response:
                response.read()

    threads = [threading.Thread(target=decode_forever, daemon=True) for _ in range(running)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # every sequence past its prefill
    try:
        busy = min(_cold_ttft_s(worker, model_dir, prompt(k)) for k in range(3, 6))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return max(busy - idle, 0.0) / running


def stalls_note(found: dict[str, float] | None) -> str:
    return "" if found is None else f"  stalls>0.3s {found['count']} ({found['seconds']:.1f} s)"


def reset_caches(workers: list[VllmServer], model_dir: Path) -> None:
    """Empty every server's prefix cache, and make each publish that it did: vLLM sends
    the ``AllBlocksCleared`` of a reset with its next scheduler step's events, so a
    router started right after a bare reset replays the last run's ``BlockStored`` and
    not the clear, and routes its first requests to blocks that are gone. A prompt
    shorter than a block runs that step and stores nothing."""
    for worker in workers:
        request = urllib.request.Request(f"{worker.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        _cold_ttft_s(worker, model_dir, [60, 61])


def run_once(
    name: str, workers: list[VllmServer], model_dir: Path, workload: str, args: argparse.Namespace,
    out: Path,
) -> dict[str, Any]:  # fmt: skip
    reset_caches(workers, model_dir)
    before = vllm_counters(workers)
    closed = args.rate is None
    load = ["--concurrency", str(args.concurrency)] if closed else ["--rate", str(args.rate)]
    if name in args.kv_aware_weights:
        router = start_kvserve_router(
            workers, model_dir, args.prefill_token_s, args.decode_request_s,
            args.kv_aware_weights[name],
        )  # fmt: skip
    elif name == "kvserve-cache_aware":  # kvserve's router with sglang-router's policy
        router = start_router([w.url for w in workers], free_port(), "--policy", "cache_aware")
    else:
        router = start_sglang_router(workers)
    try:
        subprocess.run(
            [*KVSERVE_COMMAND, "bench", "--endpoint", router.url, "--workload", workload,
             "--model", str(model_dir), *load,
             "--max-requests", str(args.requests), "--out", str(out)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        router.stop()
    results = json.loads((out / "results.json").read_text())
    summary: dict[str, Any] = results["summary"]
    # Open-loop arrivals leave the fleet idle at times: a gap there is no stall.
    summary["stalls"] = stalls(results["requests"]) if closed else None
    summary["vllm"] = {
        key: [int(a[key] - b[key]) for a, b in zip(vllm_counters(workers), before, strict=True)]
        for key in ("requests", "preemptions")
    }
    return summary


def stalls(requests: list[dict[str, Any]], longer_than_s: float = 0.3) -> dict[str, float]:
    """Stretches of a closed-loop run in which no request got its first token or finished:
    with work queued on both servers, such a gap is the whole machine stalling, whichever
    router."""
    events = sorted(
        r["start_s"] + seconds
        for r in requests
        for seconds in (r["ttft_s"], r["e2e_s"])
        if seconds is not None
    )
    gaps = [b - a for a, b in itertools.pairwise(events) if b - a > longer_than_s]
    return {"count": len(gaps), "seconds": sum(gaps), "max_s": max(gaps, default=0.0)}


def sized(spec: str, requests: int) -> str:
    if "n_prefixes" in spec:
        return f"{spec},requests={requests}"
    if spec.startswith("multi-turn"):  # a conversation makes one request per turn
        return f"{spec},conversations={max(requests // CHAT_TURNS, 1)}"
    return spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4, help="closed loop of C users")
    parser.add_argument(
        "--rate",
        type=float,
        help="open loop instead: Poisson arrivals per second (of conversations, in chat-sessions)",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/foreign-fleet"))
    parser.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS[:2]))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument(
        "--vllm-processes",
        choices=["default", "single"],
        default="single",
        help="single: each server's engine and worker in its API server's process (vLLM's "
        "default layout busy-polls between its processes and stalls a small machine)",
    )
    parser.add_argument(
        "--pin-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM server i runs on CPU i only (as each GPU worker has its own device)",
    )
    parser.add_argument(
        "--vllm-kv-blocks",
        type=int,
        help="each vLLM server's KV cache holds this many blocks of 32 tokens (vLLM's "
        "--num-gpu-blocks-override; at least 65: a 2,048-token context and the null "
        "block), not 1 GiB's worth",
    )
    parser.add_argument(
        "--recompute-weights",
        type=float,
        nargs="*",
        default=[],
        help="besides kvserve-kv_aware (the router's default weights), kvserve-kv_aware-wW "
        "with --kv-aware-recompute-weight W, for each W",
    )
    args = parser.parse_args()
    args.kv_aware_weights = {KV_AWARE: None} | {
        f"{KV_AWARE}-w{w:g}": w for w in args.recompute_weights
    }
    args.routers = [
        r for name in args.routers for r in (args.kv_aware_weights if name == KV_AWARE else [name])
    ]
    # Generated workloads make as many requests as asked (shared-prefix's default is 256).
    workloads = {name: sized(WORKLOADS[name], args.requests) for name in args.workloads}
    model_dir = make_model()
    single = args.vllm_processes == "single"
    cores = sorted(os.sched_getaffinity(0))
    workers = [
        VllmServer(
            model_dir,
            dev_mode=True,
            kv_cache_gib=1,
            kv_blocks=args.vllm_kv_blocks,
            single_process=single,
            core=cores[i % len(cores)] if args.pin_workers else None,
            compiled=True,
        )
        for i in range(2)
    ]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in workloads}
    try:
        for worker in workers:
            worker.wait_healthy(600)
        args.prefill_token_s = prefill_token_s(workers[0], model_dir)
        args.decode_request_s = decode_request_s(workers[0], model_dir)
        print(
            f"prefill: {args.prefill_token_s * 1e6:.1f} us per prompt token; a running "
            f"sequence adds {args.decode_request_s * 1e3:.2f} ms to a new prompt's TTFT",
            flush=True,
        )
        for round_index in range(args.rounds):
            order = args.routers if round_index % 2 == 0 else args.routers[::-1]
            for workload_name, spec in workloads.items():
                for name in order:
                    out = args.out / f"{workload_name}-{name}-r{round_index}"
                    summary = run_once(name, workers, model_dir, spec, args, out)
                    results[workload_name].setdefault(name, []).append(summary)
                    ttft = summary["ttft_ms"]
                    print(
                        f"{workload_name:14} {name:20} round {round_index}: "
                        f"hit {summary['prefix_hit_rate']:.3f}  TTFT p50 {ttft['p50']:.0f} "
                        f"p99 {ttft['p99']:.0f} ms  errors {summary['errors']}  "
                        f"served by each vLLM {summary['vllm']['requests']} (preempted "
                        f"{summary['vllm']['preemptions']})" + stalls_note(summary["stalls"]),
                        flush=True,
                    )
    finally:
        for worker in workers:
            worker.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
