"""What telling the router about a non-streamed answer's first token costs, two ways.

The router holds a request's prefill load until its first token. For a non-streamed
request it can learn that moment two ways: the worker sends the answer's headers with
the first token and the body at the end (what kvserve does), or the router asks the
worker for a stream and assembles the answer itself. The second way costs at least what
a streamed request costs: one SSE event per token encoded by the worker and relayed by
the router (assembling adds a JSON parse per event on top). This runs both request
kinds through one router in front of one tiny-model worker, alternating rounds, and
reports requests/s and the CPU each process spends per request (``/proc``, Linux only).

Run: ``python benchmarks/first_token_release.py [--max-tokens 64] [--rounds 3]``
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


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _closed_loop(
    url: str, model: str, stream: bool, max_tokens: int, concurrency: int, duration_s: float
) -> int:
    """Requests completed by ``concurrency`` clients in ``duration_s`` seconds."""
    done = 0
    deadline = time.perf_counter() + duration_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client(offset: int) -> None:
            nonlocal done
            index = offset
            while time.perf_counter() < deadline:
                body = {
                    "model": model,
                    "prompt": f"Question {index} about the tides?",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "stream": stream,
                }
                async with session.post(url + "/v1/completions", json=body) as response:
                    await response.read()
                    assert response.status == 200, response.status
                done += 1
                index += concurrency

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per round")
    args = parser.parse_args()

    from kvserve.engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(Path(tempfile.mkdtemp()), "llama")
    port = free_port()
    worker = ServerProcess(
        [*KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port),
         "--device", "cpu", "--served-model-name", "tiny"],
        f"http://127.0.0.1:{port}",
        name="worker",
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    results: dict[bool, dict[str, list[float]]] = {
        s: {"rps": [], "router_us": [], "worker_us": []} for s in (False, True)
    }
    try:
        worker.wait_healthy(120)
        with start_router([worker.url], free_port()) as router:
            for stream in (False, True):  # warm up
                asyncio.run(_closed_loop(router.url, "tiny", stream, args.max_tokens, 2, 1.0))
            for round_index in range(args.rounds):
                for stream in (False, True):
                    pids = router.process.pid, worker.process.pid
                    cpu_before = [_cpu_seconds(p) for p in pids]
                    started = time.perf_counter()
                    done = asyncio.run(
                        _closed_loop(
                            router.url, "tiny", stream, args.max_tokens,
                            args.concurrency, args.duration,
                        )
                    )  # fmt: skip
                    elapsed = time.perf_counter() - started
                    used = [_cpu_seconds(p) - b for p, b in zip(pids, cpu_before, strict=True)]
                    results[stream]["rps"].append(done / elapsed)
                    results[stream]["router_us"].append(used[0] / done * 1e6)
                    results[stream]["worker_us"].append(used[1] / done * 1e6)
                print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        worker.stop()
    print(
        f"max_tokens={args.max_tokens} concurrency={args.concurrency} "
        f"rounds={args.rounds} duration={args.duration}s (medians over rounds)"
    )
    print(f"{'request':<34} {'req/s':>7} {'router CPU us/req':>18} {'worker CPU us/req':>18}")
    labels = {False: "non-streamed, headers at 1st token", True: "streamed (floor of assembling)"}
    for stream, label in labels.items():
        row = {k: statistics.median(v) for k, v in results[stream].items()}
        print(f"{label:<34} {row['rps']:>7.1f} {row['router_us']:>18.0f} {row['worker_us']:>18.0f}")


if __name__ == "__main__":
    main()
