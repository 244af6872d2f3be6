"""A ``kvserve worker`` process on a loopback port, and clients for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port

API_KEY = "test-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
BLOCK_SIZE = 16
NUM_BLOCKS = 256
STARTUP_TIMEOUT_S = 90.0


def start_worker(model_dir: Path, *extra_args: str) -> ServerProcess:
    """Starts ``kvserve worker`` with an API key and waits until /health answers."""
    port = free_port()
    args = [
        *KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port),
        "--api-key", API_KEY, "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
        "--max-num-batched-tokens", "256", "--device", "cpu", *extra_args,
    ]  # fmt: skip
    server = ServerProcess(args, f"http://127.0.0.1:{port}", name="worker")
    return server.wait_healthy(STARTUP_TIMEOUT_S)


def api(worker: ServerProcess) -> httpx.Client:
    """A client that sends the API key."""
    return httpx.Client(base_url=worker.url, headers=AUTH, timeout=60.0)


def openai_client(worker: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key=API_KEY, max_retries=0)


def served_model(worker: ServerProcess) -> str:
    return httpx.get(f"{worker.url}/v1/models", headers=AUTH).json()["data"][0]["id"]


def load(worker: ServerProcess) -> dict[str, Any]:
    return httpx.get(f"{worker.url}/load", headers=AUTH).json()
