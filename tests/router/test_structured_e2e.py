"""The official openai client through the router to a real worker: response_format and tools
(forced, streamed, refused), and the router's kv_aware hashing of a tool conversation is
the worker's own prompt (the template renders the tools on both sides)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvserve.router.local_fleet import ServerProcess
from kvserve.router.ports import free_port
from kvserve.router.prompt_tokens import PromptHasher
from tests.support.json_schemas import random_schemas
from tests.support.processes import start_router
from tests.worker.worker_process import API_KEY, AUTH, BLOCK_SIZE, start_worker

MESSAGES: list[Any] = [{"role": "user", "content": "Reply in JSON."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserve.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("structured-model"), "qwen2")


@pytest.fixture(scope="module")
def fleet(model_dir: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    worker = start_worker(model_dir)
    router = None
    try:
        router = start_router(
            [worker.url], free_port(), "--policy", "kv_aware", "--tokenizer", str(model_dir),
            "--worker-api-key", API_KEY,
        )  # fmt: skip
        yield router, worker
    finally:
        for server in (router, worker):
            if server is not None:
                server.stop()


def client_of(router: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


def tool(name: str, parameters: dict[str, Any]) -> Any:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_openai_client_gets_schema_valid_json_and_tool_calls_through_the_router(
    fleet, model_dir: Path
) -> None:
    router, _ = fleet
    client = client_of(router)
    model = model_dir.name
    schema, params = random_schemas(2, seed=21)
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=400, seed=1, response_format=response_format
    )
    content = answer.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), schema)

    streamed = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=400,
        seed=2,
        response_format={"type": "json_object"},
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert isinstance(json.loads(text), dict)

    named = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=400,
        seed=3,
        tools=[tool("lookup", params), tool("other", {"type": "object"})],
        tool_choice={"type": "function", "function": {"name": "lookup"}},
    )
    assert named.choices[0].finish_reason == "tool_calls"
    [call] = named.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "lookup"
    jsonschema.validate(json.loads(call.function.arguments), params)

    required = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=400,
        seed=4,
        tools=[tool("lookup", params)],
        tool_choice="required",
        stream=True,
    )
    arguments, finish = "", None
    for chunk in required:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.function is not None and delta.function.name == "lookup"
                arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), params)


class Weather(BaseModel):
    city: str = Field(min_length=1, max_length=8)
    celsius: int = Field(ge=-50, le=50)
    sky: Literal["clear", "cloudy", "rain"]


def test_openai_parse_helpers_get_pydantic_objects_through_the_router(
    fleet, model_dir: Path
) -> None:
    """``chat.completions.parse`` sends a strict schema built from a pydantic model and
    parses the answer into it; the same for a function tool made from the model."""
    router, _ = fleet
    client = client_of(router)
    parsed = client.chat.completions.parse(
        model=model_dir.name, messages=MESSAGES, max_tokens=200, seed=5, response_format=Weather
    )
    weather = parsed.choices[0].message.parsed
    assert isinstance(weather, Weather) and -50 <= weather.celsius <= 50

    called = client.chat.completions.parse(
        model=model_dir.name,
        messages=MESSAGES,
        max_tokens=200,
        seed=6,
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice={"type": "function", "function": {"name": "Weather"}},
    )
    [call] = called.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Weather)


def test_a_refused_schema_is_relayed_as_the_workers_400(fleet, model_dir: Path) -> None:
    router, _ = fleet
    bad: Any = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client_of(router).chat.completions.create(
            model=model_dir.name, messages=MESSAGES, max_tokens=4, response_format=bad
        )
    assert err.value.status_code == 400
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == "response_format"


def test_router_hashes_a_tool_conversation_as_the_worker_renders_it(fleet, model_dir: Path) -> None:
    router, worker = fleet
    body = {
        "model": model_dir.name,
        "max_tokens": 2,
        "tools": [tool("weather", {"type": "object", "properties": {"city": {"type": "string"}}})],
        "tool_choice": "none",
        "messages": [
            {"role": "user", "content": "What is the weather in Paris and in Rome today?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny and warm"},
        ],
    }
    answer = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    blocks = PromptHasher(model_dir).blocks(body, BLOCK_SIZE)
    assert blocks is not None
    assert blocks.num_tokens == answer.json()["usage"]["prompt_tokens"]
    snapshot = httpx.get(f"{worker.url}/kv/snapshot", headers=AUTH, timeout=10).json()
    assert len(blocks.reusable_hashes) >= 4
    assert set(blocks.reusable_hashes) <= {block_hash for block_hash, _ in snapshot["blocks"]}
