"""Prefill/decode disaggregation on this machine, side by side with a mixed worker.

Starts a prefill worker, a decode worker and a mixed worker (tiny model, CPU), then for
each prompt length sends the same cold prompts (a) to the mixed worker, (b) to the decode
worker's PD endpoint (the prefill worker computes, KV crosses TCP, decode finishes) and
(c) that PD prompt plus a fresh quarter (the prefix is cached on both sides: only the new
quarter is computed and shipped; every request here is sent remote), and prints the
median time to the complete answer (a few tokens) and the PD/mixed ratio. Also measures
``kv_block_io`` alone: device blocks -> bytes -> device blocks, in MB/s.

Run: ``python benchmarks/pd_transfer.py [--lengths 512 2048] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from kvserve.engine.kv_block_io import (
    KVBlockLayout,
    from_bytes,
    read_blocks,
    to_bytes,
    write_blocks,
)
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.tiny_model import make_tiny_model
from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port

MAX_TOKENS = 4


def start(model_dir: Path, *options: str) -> ServerProcess:
    port = free_port()
    args = [*KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port)]
    args += ["--num-blocks", "2048", "--device", "cpu", "--served-model-name", "tiny", *options]
    return ServerProcess(
        args, f"http://127.0.0.1:{port}", name="worker", env={"OMP_NUM_THREADS": "1"}
    )


def timed(
    client: httpx.Client, url: str, prompt: str, headers: dict[str, str]
) -> tuple[float, int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    started = time.perf_counter()
    response = client.post(url, json=body, headers=headers)
    assert response.status_code == 200, response.text
    cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return time.perf_counter() - started, cached


def prompt_of(seed: int, length: int) -> list[int]:
    """``length`` token ids, distinct per seed (no accidental cache hits)."""
    return [(seed * 7919 + i * 31 + i * i) % 900 + 10 for i in range(length)]


def block_io_rate(model_dir: Path, num_blocks: int = 256) -> tuple[float, float]:
    runner = ModelRunner(model_dir, num_blocks=num_blocks, block_size=16, device="cpu")
    layout = KVBlockLayout.of_runner(runner, "tiny")
    ids = list(range(num_blocks))
    started = time.perf_counter()
    payload = to_bytes(read_blocks(runner.kv_pool, layout, ids))
    export_s = time.perf_counter() - started
    started = time.perf_counter()
    write_blocks(runner.kv_pool, layout, ids, from_bytes(layout, payload))
    install_s = time.perf_counter() - started
    megabytes = len(payload) / 1e6
    return megabytes / export_s, megabytes / install_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="pd-bench-")), "llama")
    export_rate, install_rate = block_io_rate(model_dir)
    print(f"kv_block_io: export {export_rate:,.0f} MB/s, install {install_rate:,.0f} MB/s")
    prefill = start(model_dir, "--role", "prefill")
    decode = start(
        model_dir, "--role", "decode", "--pd-min-remote-tokens", "1", "--pd-local-hit-fraction", "1"
    )
    mixed = start(model_dir)
    processes = [prefill, decode, mixed]
    try:
        for process in processes:
            process.wait_healthy(120)
        pd_headers = {"x-kvserve-prefill": prefill.url}
        print("tokens  mixed_s  pd_s   pd/mixed  pd_prefix_hit_s  cached")
        with httpx.Client(timeout=120) as client:
            for length in args.lengths:
                mixed_s, pd_s, hit_s, cached = [], [], [], 0
                for round_index in range(args.rounds):
                    seed = length * 100 + 3 * round_index
                    mixed_s.append(
                        timed(client, mixed.url + "/v1/completions", prompt_of(seed, length), {})[0]
                    )
                    pd_s.append(
                        timed(
                            client,
                            decode.url + "/pd/v1/completions",
                            prompt_of(seed + 1, length),
                            pd_headers,
                        )[0]
                    )
                    # Same long prefix as the last PD prompt, a fresh quarter at the end:
                    # the prefill worker serves the prefix from its cache.
                    shared = prompt_of(seed + 1, length) + prompt_of(seed + 2, length // 4)
                    seconds, cached = timed(
                        client, decode.url + "/pd/v1/completions", shared, pd_headers
                    )
                    hit_s.append(seconds)
                m, p, h = (statistics.median(x) for x in (mixed_s, pd_s, hit_s))
                print(f"{length:6d}  {m:7.3f}  {p:5.3f}  {p / m:8.2f}  {h:15.3f}  {cached}")
    finally:
        for process in processes:
            process.stop()


if __name__ == "__main__":
    main()
