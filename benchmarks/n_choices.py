"""n=4 choices of one prompt vs the same prompt sent as 4 separate requests, through a
real ``kvserve worker`` over HTTP.

Each round draws a fresh random prompt of ``--prompt-len`` token ids (so neither side
finds it cached from an earlier round) and times, from the first byte sent to the last
byte received, either one completion with ``n=4`` or 4 concurrent completions with
``n=1`` (distinct seeds), each choice sampling ``--output-len`` tokens with EOS off. The
``n=4`` choices fork from the first choice's prompt blocks; the 4 separate requests
arrive together, so each prefills the prompt itself. The sides alternate round by round;
the script prints the median and best round of each, and the worker's prefix-cache hits
and forked-choice counters, which show where the prompt was computed once.

Run: ``python benchmarks/n_choices.py [--rounds 5] [--prompt-len 2000] [--output-len 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess, free_port

N = 4


async def one_round(
    client: httpx.AsyncClient, prompt: list[int], output_len: int, together: bool, seed: int
) -> float:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 1.0,
    }
    started = time.perf_counter()
    if together:
        response = await client.post("/v1/completions", json={**body, "n": N, "seed": seed})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == N
    else:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json={**body, "seed": seed + i}) for i in range(N))
        )
        assert all(r.status_code == 200 for r in responses)
    return time.perf_counter() - started


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise LookupError(name)


async def run(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    rng = random.Random(0)
    times: dict[str, list[float]] = {"n=4": [], "4 requests": []}
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        for round_index in range(args.rounds + 1):  # round 0 warms up
            order = [True, False] if round_index % 2 else [False, True]
            for together in order:
                prompt = [rng.randrange(10, 1000) for _ in range(args.prompt_len)]
                elapsed = await one_round(client, prompt, args.output_len, together, round_index)
                if round_index:
                    times["n=4" if together else "4 requests"].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        subprocess.run(
            [*KVSERVE_COMMAND, "make-tiny-model", str(model), "--hidden-size",
             str(args.hidden_size), "--intermediate-size", str(4 * args.hidden_size)],
            check=True, capture_output=True,
        )  # fmt: skip
        port = free_port()
        worker = ServerProcess(
            [*KVSERVE_COMMAND, "worker", "--model", str(model), "--port", str(port),
             "--device", "cpu", "--threads", str(args.threads), "--num-blocks", "2048"],
            f"http://127.0.0.1:{port}", name="worker",
        ).wait_healthy(120)  # fmt: skip
        try:
            times = asyncio.run(run(worker.url, args))
            with httpx.Client(base_url=worker.url) as client:
                hits = metric(client, "kvserve_prefix_cache_hit_tokens_total")
                forked = metric(client, "kvserve_forked_choices_total")
                shared = metric(client, "kvserve_forked_prompt_tokens_total")
        finally:
            worker.stop(timeout_s=30)
    tokens = N * args.output_len
    print(f"prompt {args.prompt_len} tokens, {N} x {args.output_len} output tokens, "
          f"hidden {args.hidden_size}, {args.rounds} rounds")  # fmt: skip
    for side, values in times.items():
        median, best = statistics.median(values), min(values)
        print(
            f"{side:>11}: median {median:.3f} s ({tokens / median:,.0f} output tok/s), "
            f"best {best:.3f} s ({tokens / best:,.0f} tok/s)"
        )
    ratio = statistics.median(times["4 requests"]) / statistics.median(times["n=4"])
    print(f"n=4 speedup (median): {ratio:.2f}x")
    print(f"worker: prefix hit tokens {hits:.0f}, forked choices {forked:.0f}, "
          f"prompt tokens shared by forks {shared:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
