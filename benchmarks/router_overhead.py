"""Router overhead: kvserve router vs sglang-router over the same fast upstreams.

Both routers run side by side in one run, for each policy asked, in front of the same
foreign OpenAI-compatible servers (which answer at once). Rounds alternate between every
target so that machine noise hits all of them alike. Reported, per target:

- added latency: median (p50) and p99 per request at concurrency 1 (a sequential Python
  client), minus the direct figure. The latency requests are interleaved, one to each
  target in turn (the order rotating), so that a burst of other work on the box lands on
  every target's tail alike instead of on whichever target's block of requests it met;
- max requests/s under a closed loop of ``--concurrency`` connections for ``--duration``
  seconds, driven by ``--client``: ``wrk`` (``wrk -t1 -cN``, a C load generator; installed
  from Debian's packages when missing) or ``python`` (aiohttp clients); with ``wrk`` also
  its p50/p99 latency under that load;
- router CPU per request in that loop (user + system time of the router process and its
  children, from ``/proc``, so Linux only): on a shared box this is steadier than
  requests/s, which also depends on how the client and the upstream get the cores.

kvserve runs once per ``--processes`` count asked (``kvserve xN``: ``kvserve router
--processes N``), so that one process and one per core compare with sglang-router, which
uses every core it is given, and once per ``--http-server`` mode asked (``lean``: the
httptools server for the OpenAI routes, ``aiohttp``: aiohttp serves them all). The load
average is printed before and after.

Run: ``python benchmarks/router_overhead.py [--client wrk] [--policy cache_aware
round_robin] [--processes 1 2] [--http-server lean aiohttp] [--rounds 5]``
(needs ``pip install sglang-router``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.router.ports import free_port
from tests.support.processes import ServerProcess, start_foreign_server, start_router

SHARED_PREFIX = "You are a helpful assistant who answers briefly and precisely. " * 16

# wrk's request generator: the same ~1 KB bodies as ``_body``, a fresh question each time
# so cache_aware walks and grows its tree; ``done`` prints what the benchmark parses.
_WRK_SCRIPT = """
local counter = 0
local prefix = string.rep("You are a helpful assistant who answers briefly and precisely. ", 16)
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  counter = counter + 1
  local body = '{"model":"foreign","prompt":"' .. prefix .. 'Question ' .. counter
    .. '?","max_tokens":4}'
  return wrk.format(nil, "/v1/completions", nil, body)
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "KVSERVE_WRK requests=%d duration_us=%d p50_us=%d p99_us=%d errors=%d status_errors=%d\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def _body(index: int) -> dict[str, object]:
    """A prompt of ~1 KB: a shared prefix then a unique question, like real chat traffic."""
    return {"model": "foreign", "prompt": f"{SHARED_PREFIX}Question {index}?", "max_tokens": 4}


def start_sglang_router(upstreams: list[str], port: int, policy: str) -> ServerProcess:
    args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--worker-urls", *upstreams, "--policy", policy]
    args += ["--log-level", "warn", "--prometheus-port", str(free_port())]
    return ServerProcess(args, f"http://127.0.0.1:{port}", name="sglang-router").wait_healthy(60)


def ensure_wrk() -> str:
    """The path of ``wrk``, installing Debian's package when it is missing."""
    found = shutil.which("wrk")
    if found is None:
        print("wrk not found: installing it with apt-get", file=sys.stderr)
        apt = ["apt-get", "install", "-y", "wrk"]
        if os.geteuid() != 0:
            apt.insert(0, "sudo")
        if subprocess.run(apt, check=False).returncode != 0:
            subprocess.run([*apt[:-3], "update"], check=True)
            subprocess.run(apt, check=True)
        found = shutil.which("wrk")
    if found is None:
        raise SystemExit("wrk is not installed and could not be installed")
    return found


@dataclass
class Target:
    """One thing the load goes to, and what its rounds measured."""

    label: str
    process: ServerProcess
    latency: list[float] = field(default_factory=list)
    round_p99: list[float] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)
    cpu_per_request: list[float] = field(default_factory=list)
    loaded_p50: list[float] = field(default_factory=list)
    loaded_p99: list[float] = field(default_factory=list)


async def _latencies(urls: list[str], requests: int) -> list[list[float]]:
    """Seconds per request for each url, ``requests`` each, sent one url after another."""
    sessions = [aiohttp.ClientSession() for _ in urls]
    seconds: list[list[float]] = [[] for _ in urls]
    try:
        for index in range(requests):
            for turn in range(len(urls)):
                which = (index + turn) % len(urls)
                started = time.perf_counter()
                async with sessions[which].post(
                    urls[which] + "/v1/completions", json=_body(index)
                ) as response:
                    await response.read()
                    assert response.status == 200, response.status
                seconds[which].append(time.perf_counter() - started)
        return seconds
    finally:
        for session in sessions:
            await session.close()


async def _python_load(url: str, concurrency: int, duration_s: float) -> int:
    """Requests answered by ``concurrency`` aiohttp clients in a closed loop."""
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

        await asyncio.gather(*(client(i) for i in range(concurrency)))
        return done


def _wrk_load(
    wrk: str, script: Path, url: str, concurrency: int, duration_s: float
) -> tuple[int, float, float]:
    """Requests answered, p50 and p99 seconds under ``wrk -t1 -c<concurrency>``."""
    command = [wrk, "-t1", f"-c{concurrency}", f"-d{duration_s:g}s", "-s", str(script), url]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    match = re.search(
        r"KVSERVE_WRK requests=(\d+) duration_us=(\d+) p50_us=(\d+) p99_us=(\d+) "
        r"errors=(\d+) status_errors=(\d+)",
        output,
    )
    if match is None:
        raise RuntimeError(f"unexpected wrk output:\n{output}")
    requests, _, p50, p99, errors, status_errors = (int(g) for g in match.groups())
    if status_errors or errors:
        raise RuntimeError(f"wrk saw {errors} socket errors and {status_errors} non-2xx")
    return requests, p50 / 1e6, p99 / 1e6


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time the process and its live descendants have used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(_cpu_seconds(child) for child in _children(pid))


def _children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def _measure_latency(targets: list[Target], requests: int) -> None:
    urls = [target.process.url for target in targets]
    for target, seconds in zip(targets, asyncio.run(_latencies(urls, requests)), strict=True):
        target.latency += seconds
        target.round_p99.append(_percentile(seconds, 99))


def _run_load(target: Target, args: argparse.Namespace, wrk: str | None, script: Path) -> None:
    pid = target.process.process.pid
    cpu_before, started_at = _cpu_seconds(pid), time.perf_counter()
    if wrk is None:
        served = asyncio.run(_python_load(target.process.url, args.concurrency, args.duration))
    else:
        served, p50, p99 = _wrk_load(
            wrk, script, target.process.url, args.concurrency, args.duration
        )
        target.loaded_p50.append(p50)
        target.loaded_p99.append(p99)
    elapsed = time.perf_counter() - started_at
    target.throughput.append(served / elapsed)
    target.cpu_per_request.append((_cpu_seconds(pid) - cpu_before) / served)


def _report(targets: list[Target], args: argparse.Namespace) -> None:
    direct = targets[0]
    direct_p50 = statistics.median(direct.latency)
    direct_p99 = _percentile(direct.latency, 99)
    print(
        f"client={args.client} rounds={args.rounds} requests/round={args.requests} "
        f"concurrency={args.concurrency} duration={args.duration}s backends={args.backends} "
        f"cores={os.cpu_count()}"
    )
    print(
        f"{'target':<34} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>8} {'+p99 ms':>8} "
        f"{'req/s':>7} {'load p50':>9} {'load p99':>9} {'CPU us/req':>10}"
    )
    for target in targets:
        p50, p99 = statistics.median(target.latency), _percentile(target.latency, 99)
        loaded = (
            f"{statistics.median(target.loaded_p50) * 1e3:>9.2f} "
            f"{statistics.median(target.loaded_p99) * 1e3:>9.2f}"
            if target.loaded_p50
            else f"{'-':>9} {'-':>9}"
        )
        print(
            f"{target.label:<34} {p50 * 1e3:>7.2f} {p99 * 1e3:>7.2f} "
            f"{(p50 - direct_p50) * 1e3:>8.2f} {(p99 - direct_p99) * 1e3:>8.2f} "
            f"{statistics.median(target.throughput):>7.0f} {loaded} "
            f"{statistics.median(target.cpu_per_request) * 1e6:>10.0f}"
        )
    for policy in args.policy:
        sg = next(t for t in targets if t.label == f"sglang {policy}")
        for server, processes in itertools.product(args.http_server, args.processes):
            label = f"kvserve {server} x{processes} {policy}"
            kv = next(t for t in targets if t.label == label)
            ratios = [k / s for k, s in zip(kv.throughput, sg.throughput, strict=True)]
            rps = statistics.median(kv.throughput) / statistics.median(sg.throughput)
            cpu = statistics.median(kv.cpu_per_request) / statistics.median(sg.cpu_per_request)
            per_round = ", ".join(f"{r:.2f}" for r in ratios)
            print(
                f"{policy}: kvserve {server} x{processes}/sglang req/s {rps:.2f} "
                f"(per round: {per_round}), CPU per request {cpu:.2f}"
            )
    for target in targets:
        rounds = ", ".join(f"{r:.0f}" for r in target.throughput)
        p99s = ", ".join(f"{p * 1e3:.1f}" for p in target.loaded_p99)
        quiet = ", ".join(f"{p * 1e3:.2f}" for p in target.round_p99)
        print(
            f"{target.label}: req/s per round {rounds}; load p99 ms per round {p99s or '-'}; "
            f"concurrency-1 p99 ms per round {quiet}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    policies = ["cache_aware", "round_robin", "random", "power_of_two"]
    parser.add_argument(
        "--policy", nargs="+", default=["cache_aware", "round_robin"], choices=policies
    )
    parser.add_argument("--client", default="wrk", choices=["wrk", "python"])
    parser.add_argument("--backends", type=int, default=2, help="fast upstream servers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300, help="per latency round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per load round")
    parser.add_argument(
        "--processes", type=int, nargs="+", default=[1, 2], help="kvserve router process counts"
    )
    parser.add_argument(
        "--http-server",
        nargs="+",
        default=["lean", "aiohttp"],
        choices=["lean", "aiohttp"],
        help="kvserve router --http-server modes",
    )
    parser.add_argument(
        "--router-option", action="append", default=[], help="extra kvserve router flag"
    )
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    wrk = ensure_wrk() if args.client == "wrk" else None

    started: list[ServerProcess] = []
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as handle:
        handle.write(_WRK_SCRIPT)
    script = Path(handle.name)
    try:
        backends = [start_foreign_server(f"fast{i}", free_port()) for i in range(args.backends)]
        started += backends
        urls = [b.url for b in backends]
        targets = [Target("direct (one backend)", backends[0])]
        for policy in args.policy:
            extra = [part for option in args.router_option for part in option.split()]
            for server, processes in itertools.product(args.http_server, args.processes):
                options = ["--policy", policy, "--processes", str(processes), *extra]
                options += ["--http-server", server]
                kv = start_router(urls, free_port(), *options)
                started.append(kv)
                targets.append(Target(f"kvserve {server} x{processes} {policy}", kv))
            sg = start_sglang_router(urls, free_port(), policy)
            started.append(sg)
            targets.append(Target(f"sglang {policy}", sg))
        asyncio.run(_latencies([t.process.url for t in targets], 20))  # warm the trees
        for round_index in range(args.rounds):
            _measure_latency(targets, args.requests)
            for target in targets:
                _run_load(target, args, wrk, script)
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for process in reversed(started):
            process.stop()
        script.unlink()
    print(f"load average after: {os.getloadavg()}")
    _report(targets, args)


if __name__ == "__main__":
    main()
