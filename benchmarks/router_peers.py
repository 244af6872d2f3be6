"""What announcing costs a router replica: ``--peers`` vs alone.

Two cost-model workers (the tiny profile: answers in milliseconds), and three routers
(``--policy``, kv_aware by default; cache_aware announces each prompt's text) over them:
``solo`` (no peers), and ``A`` and ``B`` peering with each other.
Rounds alternate between ``solo`` and ``A`` so that machine noise hits both alike; in
each, a closed loop of ``--concurrency`` aiohttp clients sends ~1 KB completions (a shared
system prompt, a fresh question each) for ``--duration`` seconds. Reported per round and
as medians: requests/s, the router's CPU per request (user + system, from ``/proc``, so
Linux only) and, for ``A``, the CPU its peer ``B`` spent receiving and applying A's
announcements, per request of A's.

Run: ``python benchmarks/router_peers.py [--policy kv_aware] [--rounds 5] [--duration 10]
[--concurrency 8]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port
from tests.support.processes import start_router

SYSTEM = "You are a helpful assistant who answers briefly and precisely. " * 16


def _start_worker(model_dir: Path) -> ServerProcess:
    port = free_port()
    args = [
        *KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port),
        "--runner", "sim", "--sim-profile", "tiny", "--num-blocks", "4096",
        "--served-model-name", "tiny",
    ]  # fmt: skip
    return ServerProcess(args, f"http://127.0.0.1:{port}", name="sim-worker").wait_healthy(120)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(url: str, concurrency: int, duration_s: float, offset: int) -> int:
    """Requests answered by ``concurrency`` clients in a closed loop."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        deadline = time.perf_counter() + duration_s
        done = 0

        async def client(index: int) -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                body = {"model": "tiny", "prompt": f"{SYSTEM}Question {index}?", "max_tokens": 2}
                async with session.post(url + "/v1/completions", json=body) as response:
                    await response.read()
                    assert response.status == 200, response.status
                done += 1
                index += concurrency

        await asyncio.gather(*(client(offset + i) for i in range(concurrency)))
        return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--policy", default="kv_aware", choices=("kv_aware", "cache_aware"))
    args = parser.parse_args()
    from kvserve.engine.tiny_model import make_tiny_model

    servers: list[ServerProcess] = []
    try:
        model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="router-peers-")), "llama")
        workers = [_start_worker(model_dir) for _ in range(2)]
        servers += workers
        urls = [w.url for w in workers]
        kv = ("--policy", args.policy, "--tokenizer", str(model_dir))
        solo = start_router(urls, free_port(), *kv)
        servers.append(solo)
        port_a, port_b = free_port(), free_port()
        a = start_router(urls, port_a, *kv, "--peers", f"http://127.0.0.1:{port_b}")
        servers.append(a)
        b = start_router(urls, port_b, *kv, "--peers", f"http://127.0.0.1:{port_a}")
        servers.append(b)
        print(f"policy {args.policy}; load average at start: {os.getloadavg()}")
        rows: dict[str, list[tuple[float, float, float]]] = {"solo": [], "A (peers)": []}
        offset = 0
        for round_index in range(args.rounds):
            for label, router in (("solo", solo), ("A (peers)", a)):
                pids = (router.process.pid, b.process.pid)
                before = [_cpu_seconds(p) for p in pids]
                started = time.perf_counter()
                served = asyncio.run(_load(router.url, args.concurrency, args.duration, offset))
                offset += 1_000_000
                elapsed = time.perf_counter() - started
                own, peer = (_cpu_seconds(p) - c for p, c in zip(pids, before, strict=True))
                peer_part = peer / served if router is a else float("nan")
                rows[label].append((served / elapsed, own / served * 1e6, peer_part * 1e6))
                print(
                    f"round {round_index + 1} {label:>10}: {served / elapsed:7.1f} req/s, "
                    f"router CPU {own / served * 1e6:6.0f} us/req, "
                    f"peer B CPU {peer_part * 1e6:6.0f} us/req  (load {os.getloadavg()[0]:.2f})"
                )
        print("\nmedians over rounds:")
        for label, values in rows.items():
            rate, cpu, peer_cpu = (
                statistics.median(column) for column in zip(*values, strict=True)
            )
            print(
                f"{label:>10}: {rate:7.1f} req/s, router CPU {cpu:6.0f} us/req, "
                f"peer B {peer_cpu:6.0f} us/req"
            )
        solo_cpu = statistics.median(v[1] for v in rows["solo"])
        peer_cpu = statistics.median(v[1] for v in rows["A (peers)"])
        print(
            f"announcing adds {peer_cpu - solo_cpu:+.0f} us of router CPU per request "
            f"({peer_cpu / solo_cpu:.2f}x)"
        )
        print(f"load average at end: {os.getloadavg()}")
    finally:
        for server in reversed(servers):
            server.stop()


if __name__ == "__main__":
    main()
