"""Router overhead: kvserve router vs sglang-router over the same fake-fast upstream.

Both routers run side by side in one run, in front of the same foreign OpenAI-compatible
server (which answers at once), with the same policy. Rounds alternate between targets so
that machine noise hits all of them alike. Reported:

- added latency: median (p50) and p99 per request at concurrency 1, minus the direct figure;
- max requests/s: a closed loop of ``--concurrency`` clients for ``--duration`` seconds;
- router CPU per request in that loop (user + system time of the router process, from
  ``/proc``, so Linux only): on a shared box this is steadier than requests/s, which
  also depends on how the client and the upstream get the cores.

Run: ``python benchmarks/router_overhead.py [--policy cache_aware] [--rounds 3]``
(needs ``pip install sglang-router``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.ports import free_port
from tests.support.processes import ServerProcess, start_foreign_server, start_router

SHARED_PREFIX = "You are a helpful assistant who answers briefly and precisely. " * 16


def _body(index: int) -> dict[str, object]:
    """A prompt of ~1 KB: a shared prefix then a unique question, like real chat traffic."""
    return {"model": "foreign", "prompt": f"{SHARED_PREFIX}Question {index}?", "max_tokens": 4}


def start_sglang_router(upstream: str, port: int, policy: str) -> ServerProcess:
    args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--worker-urls", upstream, "--policy", policy]
    args += ["--log-level", "warn"]
    return ServerProcess(args, f"http://127.0.0.1:{port}", name="sglang-router").wait_healthy(60)


async def _latencies(url: str, requests: int) -> list[float]:
    async with aiohttp.ClientSession() as session:
        seconds = []
        for index in range(requests):
            started = time.perf_counter()
            async with session.post(url + "/v1/completions", json=_body(index)) as response:
                await response.read()
                assert response.status == 200, response.status
            seconds.append(time.perf_counter() - started)
        return seconds


async def _throughput(url: str, concurrency: int, duration_s: float) -> float:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        deadline = time.perf_counter() + duration_s
        done = 0

        async def client(offset: int) -> None:
            nonlocal done
            index = offset
            while time.perf_counter() < deadline:
                async with session.post(url + "/v1/completions", json=_body(index)) as response:
                    await response.read()
                    assert response.status == 200, response.status
                done += 1
                index += concurrency

        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        return done / (time.perf_counter() - started)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policy",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "random", "power_of_two"],
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300, help="per latency round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per throughput round")
    args = parser.parse_args()

    started: list[ServerProcess] = []
    try:
        started.append(start_foreign_server("fast", free_port()))
        started.append(start_router([started[0].url], free_port(), "--policy", args.policy))
        started.append(start_sglang_router(started[0].url, free_port(), args.policy))
        targets = dict(zip(("direct", "kvserve", "sglang"), started, strict=True))
        latency: dict[str, list[float]] = {name: [] for name in targets}
        throughput: dict[str, list[float]] = {name: [] for name in targets}
        cpu_per_request: dict[str, list[float]] = {name: [] for name in targets}
        for target in targets.values():  # warm connections and the routers' trees
            asyncio.run(_latencies(target.url, 20))
        for round_index in range(args.rounds):
            for name, target in targets.items():
                latency[name] += asyncio.run(_latencies(target.url, args.requests))
                cpu_before, started_at = _cpu_seconds(target.process.pid), time.perf_counter()
                rate = asyncio.run(_throughput(target.url, args.concurrency, args.duration))
                requests = rate * (time.perf_counter() - started_at)
                cpu_used = _cpu_seconds(target.process.pid) - cpu_before
                throughput[name].append(rate)
                cpu_per_request[name].append(cpu_used / requests)
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for process in reversed(started):
            process.stop()

    direct_p50 = statistics.median(latency["direct"])
    direct_p99 = _percentile(latency["direct"], 99)
    print(
        f"policy={args.policy} rounds={args.rounds} requests/round={args.requests} "
        f"concurrency={args.concurrency} duration={args.duration}s"
    )
    print(
        f"{'target':<8} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} "
        f"{'max req/s':>10} {'CPU us/req':>10}"
    )
    for name in targets:
        p50 = statistics.median(latency[name])
        p99 = _percentile(latency[name], 99)
        rps = statistics.median(throughput[name])
        cpu = statistics.median(cpu_per_request[name])
        print(
            f"{name:<8} {p50 * 1e3:>8.2f} {p99 * 1e3:>8.2f} {(p50 - direct_p50) * 1e3:>10.2f} "
            f"{(p99 - direct_p99) * 1e3:>10.2f} {rps:>10.0f} {cpu * 1e6:>10.0f}"
        )
    kv, sg = statistics.median(latency["kvserve"]), statistics.median(latency["sglang"])
    print(
        f"kvserve/sglang added-latency ratio (p50): "
        f"{(kv - direct_p50) / max(sg - direct_p50, 1e-9):.2f}"
    )
    for label, values in (("max req/s", throughput), ("CPU per request", cpu_per_request)):
        ratio = statistics.median(values["kvserve"]) / statistics.median(values["sglang"])
        print(f"kvserve/sglang {label} ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
