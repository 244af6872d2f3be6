"""The worker app in-process: a fault inside a generation route is still an OpenAI body."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from kvserve.engine.llm_engine import LLMEngine
from kvserve.worker.app import build_app
from kvserve.worker.config import WorkerConfig


async def test_a_fault_in_a_generation_route_is_a_500_with_an_openai_error_body(
    tiny_model_dir: Path,
) -> None:
    torch.set_num_threads(1)
    engine = LLMEngine(tiny_model_dir, num_blocks=64, device="cpu")
    # The lifespan is not run, so the engine thread never starts: handing it the request
    # fails inside the route, past validation.
    app = build_app(WorkerConfig(tiny_model_dir, worker_id="w1"), engine)
    body = {"model": engine.model_name, "prompt": "hello", "max_tokens": 1}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 500, response.text
    assert response.json()["error"] == {
        "message": "Internal error: RuntimeError",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert response.headers["x-kvserve-worker"] == "w1"
