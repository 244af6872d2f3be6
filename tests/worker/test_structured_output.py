"""response_format and tools through a real worker serving the tiny random-weight Llama: the
grammar alone makes its output parse and fit the schema, tool calls come back in OpenAI's
shape (streamed too), and every malformed or unsupported request is a 400 naming its field
that leaves nothing held in the engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from kvserve.router.local_fleet import ServerProcess
from tests.support.json_schemas import random_schemas
from tests.worker.test_bad_input import assert_error
from tests.worker.worker_process import (
    NUM_BLOCKS,
    api,
    load,
    openai_client,
    served_model,
    start_worker,
)

MESSAGES = [{"role": "user", "content": "Reply in JSON."}]
CONCURRENCY = 8


def chat(worker: ServerProcess, **fields: Any) -> dict[str, Any]:
    body = {"model": served_model(worker), "messages": MESSAGES, "max_tokens": 400, **fields}
    with api(worker) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


F = [tool("f", {"type": "object"})]
NAMED_G = {"type": "function", "function": {"name": "g"}}
JSON = {"type": "json_object"}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def assert_idle(worker: ServerProcess) -> None:
    state = load(worker)
    assert (state["running"], state["waiting"]) == (0, 0)
    assert state["free_blocks"] + state["cached_blocks"] == NUM_BLOCKS
    with api(worker) as client:
        assert client.get("/debug/check").json() == {"ok": True}


def test_fifty_random_json_schemas_give_output_that_parses_and_validates(worker) -> None:
    schemas = random_schemas(50, seed=15)

    def ask(i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": f"s{i}", "schema": schemas[i]},
        }
        return schemas[i], chat(worker, response_format=response_format, seed=i)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(ask, range(len(schemas))))
    for schema, body in answers:
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert_idle(worker)


def test_fifty_named_tool_choices_give_arguments_that_fit_the_parameters(worker) -> None:
    schemas = random_schemas(50, seed=16)

    def ask(i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        tools = [tool("other", {"type": "object"}), tool(f"fn_{i}", schemas[i])]
        choice = {"type": "function", "function": {"name": f"fn_{i}"}}
        return schemas[i], chat(worker, tools=tools, tool_choice=choice, seed=i)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(ask, range(len(schemas))))
    for i, (schema, body) in enumerate(answers):
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        message = choice["message"]
        assert message["content"] is None
        [call] = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == f"fn_{i}"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    assert_idle(worker)


def test_required_tool_choice_calls_listed_tools_with_valid_arguments(worker) -> None:
    schemas = dict(zip(("alpha", "beta", "gamma"), random_schemas(3, seed=17), strict=True))
    tools = [tool(name, schema) for name, schema in schemas.items()]
    for seed in range(4):
        body = chat(worker, tools=tools, tool_choice="required", seed=seed)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert calls
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
    one = chat(worker, tools=tools, tool_choice="required", parallel_tool_calls=False, seed=9)
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1


def test_streamed_tool_call_and_streamed_json_with_the_openai_client(worker) -> None:
    client = openai_client(worker)
    schema = random_schemas(1, seed=18)[0]
    stream = client.chat.completions.create(
        model=served_model(worker),
        messages=MESSAGES,
        max_tokens=400,
        seed=1,
        tools=[tool("lookup", schema)],
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert calls[0]["name"] == "lookup"
    jsonschema.validate(json.loads(calls[0]["arguments"]), schema)

    stream = client.chat.completions.create(
        model=served_model(worker),
        messages=MESSAGES,
        max_tokens=400,
        seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_on_completions_and_max_tokens_cut_reported_as_length(worker) -> None:
    body = {
        "model": served_model(worker),
        "prompt": "JSON:",
        "max_tokens": 400,
        "seed": 3,
        "response_format": {"type": "json_object"},
    }
    with api(worker) as client:
        answer = client.post("/v1/completions", json=body).json()
        assert isinstance(json.loads(answer["choices"][0]["text"]), dict)
        long_string = {"type": "string", "minLength": 40, "maxLength": 50}
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": long_string},
        }
        cut = client.post(
            "/v1/completions", json=body | {"max_tokens": 3, "response_format": response_format}
        )
    assert cut.json()["choices"][0]["finish_reason"] == "length"
    forced = {"type": "function", "function": {"name": "f"}}
    cut_call = chat(worker, tools=[tool("f", long_string)], tool_choice=forced, max_tokens=3)
    choice = cut_call["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"] and choice["message"]["content"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": schema_format({"type": "nope"})}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": JSON, "min_tokens": 2}, "min_tokens"),
        ({"tools": [tool("f", {"type": 3})], "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools"),
        ({"tools": [tool("bad name!", {})]}, "tools"),
        ({"tools": F, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": F, "tool_choice": NAMED_G}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": F, "tool_choice": "required", "response_format": JSON},
            "response_format",
        ),
    ],
)
def test_bad_structured_requests_are_400_naming_the_field(worker, fields, param) -> None:
    body = {"model": served_model(worker), "messages": MESSAGES, "max_tokens": 4, **fields}
    with api(worker) as client:
        assert_error(client.post("/v1/chat/completions", json=body), 400, param)
    assert_idle(worker)


def test_auto_tool_choice_on_a_llama_template_answers_and_tool_turns_render(worker) -> None:
    tools = [tool("weather", {"type": "object", "properties": {"city": {"type": "string"}}})]
    answer = chat(worker, tools=tools, max_tokens=8, seed=0)  # tool_choice defaults to auto
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    stream = openai_client(worker).chat.completions.create(
        model=served_model(worker), messages=MESSAGES, tools=tools, max_tokens=8, seed=0,
        stream=True,
    )  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    # no call in this answer: its content streams token by token, as without tools
    contents = [c.delta.content for c in chunks if c.delta.content]
    assert len(contents) > 1
    assert "".join(contents) == answer["choices"][0]["message"]["content"]
    assert chunks[-1].finish_reason == answer["choices"][0]["finish_reason"]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
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
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    answer = chat(worker, messages=history, tools=tools, tool_choice="none", max_tokens=4)
    assert answer["choices"][0]["message"]["content"] is not None


@pytest.fixture(scope="module")
def worker_without_tool_template(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    """A model whose chat template renders no tools, so no tool-call format is known."""
    from kvserve.engine.tiny_model import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("no-tools"), "qwen2")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n"
    )
    config_path.write_text(json.dumps(config))
    server = start_worker(Path(folder))
    yield server
    assert server.stop(timeout_s=30) == 0, server.log_tail()


def test_auto_tool_choice_without_a_known_format_is_refused_but_forced_calls_work(
    worker_without_tool_template: ServerProcess,
) -> None:
    worker = worker_without_tool_template
    tools = [
        tool(
            "f",
            {
                "type": "object",
                "properties": {"x": {"type": "integer"}},
                "required": ["x"],
                "additionalProperties": False,
            },
        )
    ]
    body = {"model": served_model(worker), "messages": MESSAGES, "max_tokens": 400, "tools": tools}
    with api(worker) as client:
        error = assert_error(client.post("/v1/chat/completions", json=body), 400, "tool_choice")
        assert "auto" in error["message"]
        forced_body = body | {"tool_choice": "required", "parallel_tool_calls": False}
        forced = client.post("/v1/chat/completions", json=forced_body)
    assert forced.status_code == 200, forced.text
    [call] = forced.json()["choices"][0]["message"]["tool_calls"]
    assert isinstance(json.loads(call["function"]["arguments"])["x"], int)
    assert_idle(worker)


def test_the_worker_serves_plain_requests_after_structured_ones(worker) -> None:
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        assert client.get("/health").status_code == 200
    assert chat(worker, max_tokens=3)["choices"][0]["message"]["content"] is not None
