"""Time to first token of a long prompt served from each KV tier, side by side.

A 4,096-token prompt whose first 90% (3,680 tokens, 230 blocks) another prompt already
computed is served by the tiny model (``make_tiny_model``, llama, context raised to
8,192 so the prompt fits) on the CPU, five ways, in one run:

- **cold**: nothing cached, the whole prompt is computed;
- **device**: the prefix is in the device pool (a plain prefix-cache hit);
- **host**: the device pool was cleared, the prefix is in the host tier;
- **file** / **redis** / **mooncake**: a fresh engine sharing the storage tier of the
  engine that served the first prompt loads the prefix from a directory / a local
  redis-server / a local Mooncake Store (``mooncake_master`` and one ``mooncake_client``
  holding a 1 GiB segment, Mooncake's TCP transport).

Each round measures every case once (alternating, so machine noise hits all alike);
figures are medians, printed as ratios to cold. The tiny model computes fast, so these
ratios understate what loading saves on a real model, where a token's compute grows with
the model and its KV bytes grow far less.

Run: ``python benchmarks/tiers.py [--rounds 5]`` (redis is skipped if redis-server is
not installed, mooncake if the ``kvserve[mooncake]`` extra is not).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.kv_tier_config import KVTierConfig
from kvserve.engine.kv_tiers.connector import KVTiers, kv_tiers
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.tiny_model import make_tiny_model
from kvserve.router.ports import free_port

PROMPT_TOKENS = 4096
SHARED_TOKENS = 3680  # 90%, rounded down to whole blocks of 16
NUM_BLOCKS = 600


def ttft_s(engine: LLMEngine, request_id: str, prompt: list[int]) -> float:
    """Seconds from add_request to the first generated token (the request then ends)."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        if any(output.new_token_ids for output in engine.step()):
            elapsed = time.perf_counter() - start
            while engine.has_unfinished_requests():
                engine.step()
            return elapsed
    raise RuntimeError("no token")


def model_folder(root: Path) -> Path:
    folder = make_tiny_model(root / "tiny", "llama")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = 2 * PROMPT_TOKENS
    config_path.write_text(json.dumps(config))
    return folder


class Bench:
    def __init__(self, model: Path, storages: dict[str, str]) -> None:
        self.model = model
        self.storages = storages
        self.round = 0
        rng = random.Random(0)
        self.shared = [rng.randrange(5, 990) for _ in range(SHARED_TOKENS)]

    def prompts(self) -> tuple[list[int], list[int]]:
        """A warm-up prompt and the measured one: same prefix (new every round, so no
        round finds the last one's blocks), different tails."""
        self.round += 1
        rng = random.Random(self.round)
        shared = [*self.shared[:-1], 990 + self.round % 9]
        tails = [[rng.randrange(5, 990) for _ in range(PROMPT_TOKENS - SHARED_TOKENS)]
                 for _ in range(2)]  # fmt: skip
        return [*shared, *tails[0]], [*shared, *tails[1]]

    def engine(self, tiers: KVTierConfig | None = None) -> LLMEngine:
        connectors = [kv_tiers(tiers)] if tiers is not None else []
        return LLMEngine(self.model, num_blocks=NUM_BLOCKS, device="cpu", connectors=connectors)

    def cold(self) -> float:
        return ttft_s(self.engine(), "m", self.prompts()[1])

    def device(self) -> float:
        engine = self.engine()
        warm, measured = self.prompts()
        ttft_s(engine, "w", warm)
        return ttft_s(engine, "m", measured)

    def host(self) -> float:
        engine = self.engine(KVTierConfig(host_blocks=NUM_BLOCKS))
        warm, measured = self.prompts()
        ttft_s(engine, "w", warm)
        engine.kv_cache.clear()
        return ttft_s(engine, "m", measured)

    def storage(self, name: str) -> float:
        config = KVTierConfig(storage=self.storages[name])
        warm, measured = self.prompts()
        writer = self.engine(config)
        ttft_s(writer, "w", warm)
        writer.close()  # every block written before the reader starts
        reader = self.engine(config)
        took = ttft_s(reader, "m", measured)
        stats = reader.connector(KVTiers).stats
        assert stats.storage_hit_tokens >= SHARED_TOKENS - 16, stats
        reader.close()
        return took


def start_mooncake(root: Path) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """A master and a segment holder on free ports; the storage URL and the processes."""
    programs = Path(sys.executable).parent
    port, metrics, holder, holder_http = (free_port() for _ in range(4))
    log = (root / "mooncake.log").open("ab")
    master = subprocess.Popen(
        [str(programs / "mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={port}",
         "--enable_http_metadata_server=false", f"--metrics_port={metrics}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_answering(f"http://127.0.0.1:{metrics}/metrics")
    segment = subprocess.Popen(
        [str(programs / "mooncake_client"), "--host=127.0.0.1", f"--port={holder}",
         f"--global_segment_size={1 << 30}", f"--master_server_address=127.0.0.1:{port}",
         "--metadata_server=P2PHANDSHAKE", "--enable_http_server=true",
         f"--http_port={holder_http}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_answering(f"http://127.0.0.1:{holder_http}/health")
    return f"mooncake://127.0.0.1:{port}", [segment, master]


def wait_answering(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as raw_root:
        root = Path(raw_root)
        storages = {"file": f"file:{root / 'kv'}"}
        processes: list[subprocess.Popen[bytes]] = []
        redis_process = None
        if (Path(sys.executable).parent / "mooncake_master").exists():
            storages["mooncake"], processes = start_mooncake(root)
        redis_binary = shutil.which("redis-server")
        if redis_binary:
            port = free_port()
            redis_process = subprocess.Popen(
                [redis_binary, "--port", str(port), "--save", "", "--dir", str(root)],
                stdout=subprocess.DEVNULL,
            )
            time.sleep(0.5)
            storages["redis"] = f"redis://127.0.0.1:{port}"
        try:
            bench = Bench(model_folder(root), storages)
            cases: dict[str, Callable[[], float]] = {
                "cold": bench.cold, "device": bench.device, "host": bench.host,
                **{name: (lambda n=name: bench.storage(n)) for name in storages},
            }  # fmt: skip
            times: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(args.rounds):
                for name, case in cases.items():
                    times[name].append(case())
        finally:
            for process in [*processes, *([redis_process] if redis_process else [])]:
                process.kill()
                process.wait()
    cold = statistics.median(times["cold"])
    print(f"TTFT, {PROMPT_TOKENS}-token prompt, {SHARED_TOKENS} shared; median of {args.rounds}")
    print(f"{'served from':<12}{'TTFT ms':>10}{'x cold':>9}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<12}{median * 1e3:>10.1f}{median / cold:>9.3f}")


if __name__ == "__main__":
    main()
