"""A grammar that fails mid-generation, over real HTTP: the worker runs in-process under
uvicorn, its engine's grammar library given a lexer budget too small to get past the first
token. The request gets a 500 with OpenAI's body (a stream: that error as its last event),
its blocks come back, and the worker serves the next request."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import llguidance
import pytest
import torch
import uvicorn

from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.structured_output import GrammarCompiler
from kvserve.router.ports import free_port
from kvserve.worker.app import build_app
from kvserve.worker.config import WorkerConfig

NUM_BLOCKS = 64
STARTUP_S = 60.0
SCHEMA = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}}


@pytest.fixture(scope="module")
def failing_grammar_worker(tiny_model_dir: Path) -> Iterator[str]:
    torch.set_num_threads(1)
    engine = LLMEngine(tiny_model_dir, num_blocks=NUM_BLOCKS, device="cpu")
    engine.grammars = GrammarCompiler(
        engine.tokenizer,
        engine.runner.config.vocab_size,
        engine.eos_token_ids,
        limits=llguidance.LLParserLimits(step_lexer_fuel=1),
    )
    port = free_port()
    app = build_app(WorkerConfig(tiny_model_dir, worker_id="w1"), engine)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "worker did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_failing_grammar_is_a_500_and_releases_everything(
    failing_grammar_worker: str, tiny_model_dir: Path
) -> None:
    url = failing_grammar_worker
    body = {
        "model": tiny_model_dir.name,
        "messages": [{"role": "user", "content": "JSON please"}],
        "max_tokens": 50,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
    }
    with httpx.Client(base_url=url, timeout=60) as client:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 500, response.text
        assert response.json()["error"]["code"] == "structured_output_failed"

        with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as s:
            assert s.status_code == 200
            events = [line.removeprefix("data: ") for line in s.iter_lines() if line]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "structured_output_failed"

        load = client.get("/load").json()
        assert (load["running"], load["waiting"]) == (0, 0)
        assert load["free_blocks"] + load["cached_blocks"] == NUM_BLOCKS
        assert client.get("/debug/check").json() == {"ok": True}
        plain = client.post("/v1/chat/completions", json=body | {"response_format": None})
        assert plain.status_code == 200, plain.text
