"""Worker overhead: the HTTP layer vs calling the engine directly, 1-token generations.

The same tiny model and engine settings are measured two ways in one run:

- direct: ``LLMEngine`` in this process, driven by a plain loop (add, step until done);
- http: a ``kvserve worker`` process, driven over loopback HTTP by aiohttp clients.

Reported per target: p50/p99 latency per request at concurrency 1 (a worker: all rounds), and
the best and median requests/s of a closed loop of ``--concurrency`` clients; then what
the HTTP layer adds (latency difference, ratio of best throughputs). Generations are one
token so that the model's compute is as small as it gets and the serving overhead shows.

``--baseline-src DIR`` adds a second worker whose ``kvserve`` package is imported from
``DIR`` (e.g. made by ``git archive <commit> src | tar -x -C /tmp/base``, then
``--baseline-src /tmp/base/src``), measured in rounds alternating with the current one: a
before/after of a change on a shared machine, where the load moves too much between runs.

Run: ``python benchmarks/worker_overhead.py [--requests 300] [--concurrency 16]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import aiohttp
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.tiny_model import make_tiny_model
from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port

NUM_BLOCKS = 1024
PROMPT_TOKENS = 8


def prompt(index: int) -> list[int]:
    """Distinct short prompts: no prefix-cache hits, so both sides compute the same."""
    return [10 + index % 500, *range(20, 20 + PROMPT_TOKENS - 1)]


def one_token() -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def direct_latencies(engine: LLMEngine, requests: int) -> list[float]:
    seconds = []
    for index in range(requests):
        started = time.perf_counter()
        engine.add_request(f"lat-{index}", prompt(index), one_token())
        while engine.has_unfinished_requests():
            engine.step()
        seconds.append(time.perf_counter() - started)
    return seconds


def direct_throughput(engine: LLMEngine, concurrency: int, requests: int) -> float:
    """A closed loop: each finished request is replaced at once, ``concurrency`` in flight."""
    added = finished = 0
    started = time.perf_counter()
    while finished < requests:
        while added - finished < concurrency and added < requests:
            engine.add_request(f"tput-{added}", prompt(added), one_token())
            added += 1
        finished += sum(output.finished for output in engine.step())
    return requests / (time.perf_counter() - started)


def body(model: str, index: int) -> dict[str, object]:
    return {"model": model, "prompt": prompt(index), "max_tokens": 1, "temperature": 0}


async def http_latencies(url: str, model: str, requests: int) -> list[float]:
    async with aiohttp.ClientSession() as session:
        seconds = []
        for index in range(requests):
            started = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body(model, index)) as reply:
                await reply.read()
                assert reply.status == 200, reply.status
            seconds.append(time.perf_counter() - started)
        return seconds


async def http_throughput(url: str, model: str, concurrency: int, requests: int) -> float:
    next_index = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < requests:
            index, next_index = next_index, next_index + 1
            async with session.post(f"{url}/v1/completions", json=body(model, index)) as reply:
                await reply.read()
                assert reply.status == 200, reply.status

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return requests / (time.perf_counter() - started)


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def report(name: str, latencies: list[float], throughputs: list[float]) -> None:
    p50, p99 = percentile(latencies, 50) * 1e3, percentile(latencies, 99) * 1e3
    best, median = max(throughputs), statistics.median(throughputs)
    print(f"{name:<8} p50 {p50:7.2f} ms   p99 {p99:7.2f} ms   "
          f"req/s best {best:8.1f}  median {median:8.1f}")  # fmt: skip


def start_worker(model_dir: Path, source: Path | None) -> ServerProcess:
    port = free_port()
    worker_args = [*KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port)]
    worker_args += ["--num-blocks", str(NUM_BLOCKS), "--device", "cpu"]
    env = {"PYTHONPATH": str(source)} if source else None
    server = ServerProcess(worker_args, f"http://127.0.0.1:{port}", name="worker", env=env)
    return server.wait_healthy(120)


def measure_workers(
    urls: dict[str, str], model: str, args: argparse.Namespace
) -> dict[str, tuple[list[float], list[float]]]:
    """Per worker: latencies and throughputs of all rounds; rounds alternate."""
    latencies: dict[str, list[float]] = {name: [] for name in urls}
    throughputs: dict[str, list[float]] = {name: [] for name in urls}
    for url in urls.values():
        asyncio.run(http_latencies(url, model, 20))  # warm-up
    for _ in range(args.rounds):
        for name, url in urls.items():
            latencies[name] += asyncio.run(http_latencies(url, model, args.requests))
            tput = asyncio.run(http_throughput(url, model, args.concurrency, args.requests))
            throughputs[name].append(tput)
    return {name: (latencies[name], throughputs[name]) for name in urls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds")
    parser.add_argument("--baseline-src", type=Path, help="also measure kvserve from here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "llama")

    engine = LLMEngine(model_dir, num_blocks=NUM_BLOCKS, device="cpu")
    direct_latencies(engine, 20)  # warm-up
    direct_lat = direct_latencies(engine, args.requests)
    direct_tput = [
        direct_throughput(engine, args.concurrency, args.requests) for _ in range(args.rounds)
    ]

    workers: dict[str, ServerProcess] = {}
    try:
        workers["http"] = start_worker(model_dir, None)
        if args.baseline_src:
            workers["baseline"] = start_worker(model_dir, args.baseline_src)
        urls = {name: worker.url for name, worker in workers.items()}
        measured = measure_workers(urls, model_dir.name, args)
    finally:
        for worker in workers.values():
            worker.stop(timeout_s=30)

    print(f"{args.requests} one-token requests, {PROMPT_TOKENS}-token prompts, tiny llama, "
          f"throughput at concurrency {args.concurrency} ({args.rounds} rounds)")  # fmt: skip
    report("direct", direct_lat, direct_tput)
    for name, (latencies, tput) in measured.items():
        report(name, latencies, tput)
    http_lat, http_tput = measured["http"]
    added = [(percentile(http_lat, q) - percentile(direct_lat, q)) * 1e3 for q in (50, 99)]
    print(f"HTTP layer adds p50 {added[0]:.2f} ms, p99 {added[1]:.2f} ms per request; "
          f"throughput ratio http/direct {max(http_tput) / max(direct_tput):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
