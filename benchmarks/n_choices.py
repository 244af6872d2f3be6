"""n=4 choices of one prompt vs the same prompt sent as 4 separate requests, through a
real ``kvserve worker`` over HTTP.

Each round draws a fresh random prompt of ``--prompt-len`` token ids (so neither side
finds it cached from an earlier round) and times, from the first byte sent to the last
byte received, either one completion with ``n=4`` or 4 concurrent completions with
``n=1`` (distinct seeds), each choice sampling ``--output-len`` tokens with EOS off. The
``n=4`` choices fork from the first choice's prompt blocks; the 4 separate requests
arrive together, so each prefills the prompt itself. The sides alternate round by round;
the script prints the median and best round of each, and the prompt tokens each side had
computed per round (sent less the worker's prefix-cache hits).

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

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port

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
        for r in responses:
            assert r.status_code == 200, r.text
    return time.perf_counter() - started


async def metric(client: httpx.AsyncClient, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise LookupError(name)


async def run(
    url: str, args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per round, and prompt tokens computed per round (prompt tokens sent once
    per request, less the worker's prefix-cache hits), for each side."""
    rng = random.Random(0)
    times: dict[str, list[float]] = {"n=4": [], "4 requests": []}
    computed: dict[str, list[float]] = {"n=4": [], "4 requests": []}
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        for round_index in range(args.rounds + 1):  # round 0 warms up
            order = [True, False] if round_index % 2 else [False, True]
            for together in order:
                prompt = [rng.randrange(10, 900) for _ in range(args.prompt_len)]
                hits = await metric(client, "kvserve_prefix_cache_hit_tokens_total")
                elapsed = await one_round(client, prompt, args.output_len, together, round_index)
                hits = await metric(client, "kvserve_prefix_cache_hit_tokens_total") - hits
                if round_index:
                    side = "n=4" if together else "4 requests"
                    times[side].append(elapsed)
                    computed[side].append(N * args.prompt_len - hits)
    return times, computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    # The worker's step budget: a prompt longer than it is prefilled in chunks, and
    # separate requests that arrive together then queue behind the first one's chunks,
    # matching the blocks it has committed; with a budget above 4 prompts they are
    # admitted in one step and each prefills the whole prompt.
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
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
             "--device", "cpu", "--threads", str(args.threads), "--num-blocks", "2048",
             "--max-num-batched-tokens", str(args.max_num_batched_tokens)],
            f"http://127.0.0.1:{port}", name="worker",
        ).wait_healthy(120)  # fmt: skip
        try:
            times, computed = asyncio.run(run(worker.url, args))
        finally:
            worker.stop(timeout_s=30)
    tokens = N * args.output_len
    print(f"prompt {args.prompt_len} tokens, {N} x {args.output_len} output tokens, "
          f"hidden {args.hidden_size}, step budget {args.max_num_batched_tokens}, "
          f"{args.rounds} rounds")  # fmt: skip
    for side, values in times.items():
        median, best = statistics.median(values), min(values)
        print(
            f"{side:>11}: median {median:.3f} s ({tokens / median:,.0f} output tok/s), "
            f"best {best:.3f} s ({tokens / best:,.0f} tok/s), prompt tokens computed "
            f"per round (median) {statistics.median(computed[side]):,.0f}"
        )
    ratio = statistics.median(times["4 requests"]) / statistics.median(times["n=4"])
    print(f"n=4 speedup (median): {ratio:.2f}x")


if __name__ == "__main__":
    main()
