"""Structured output and tools combined with the other API features, through a real worker:
``n`` choices each follow the grammar on their own (each choice is its own engine request
with its own matcher) and each is read back as tool calls, streamed or not; logprobs of a
constrained answer are finite (taken before the grammar's mask); ``best_of`` and ``echo``
on completions keep the grammar."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import jsonschema

from kvserve.router.local_fleet import ServerProcess
from tests.support.json_schemas import random_schemas
from tests.worker.test_structured_output import MESSAGES, assert_idle, chat, schema_format, tool
from tests.worker.worker_process import api, openai_client, served_model

N = 3


def sse_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def test_n_choices_each_follow_the_schema(worker: ServerProcess) -> None:
    schema = random_schemas(1, seed=21)[0]
    body = chat(worker, response_format=schema_format(schema), n=N, seed=4)
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(N))
    texts = [c["message"]["content"] for c in choices]
    for choice, text in zip(choices, texts, strict=True):
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1, "choices are sampled on their own (seeds seed + i)"
    assert body["usage"]["completion_tokens"] > 0
    assert_idle(worker)


def test_n_choices_each_read_back_as_tool_calls(worker: ServerProcess) -> None:
    schemas = dict(zip(("alpha", "beta"), random_schemas(2, seed=22), strict=True))
    tools = [tool(name, schema) for name, schema in schemas.items()]
    named = {"type": "function", "function": {"name": "beta"}}
    for tool_choice in (named, "required"):
        body = chat(worker, tools=tools, tool_choice=tool_choice, n=N, seed=6)
        assert len(body["choices"]) == N
        for choice in body["choices"]:
            assert choice["finish_reason"] == "tool_calls", choice
            assert choice["message"]["content"] is None
            calls = choice["message"]["tool_calls"]
            assert calls and all(c["id"].startswith("call_") for c in calls)
            for call in calls:
                name = call["function"]["name"]
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
    assert_idle(worker)


def test_n_streamed_tool_calls_come_per_choice(worker: ServerProcess) -> None:
    schema = random_schemas(1, seed=23)[0]
    stream = openai_client(worker).chat.completions.create(
        model=served_model(worker),
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=400,
        n=N,
        seed=8,
        tools=[tool("lookup", schema)],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finishes: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0  # one call per choice
                entry = calls.setdefault(choice.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""  # type: ignore[union-attr]
                entry["arguments"] += delta.function.arguments or ""  # type: ignore[union-attr]
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert finishes == dict.fromkeys(range(N), "tool_calls")
    assert sorted(calls) == list(range(N))
    for entry in calls.values():
        assert entry["name"] == "lookup"
        jsonschema.validate(json.loads(entry["arguments"]), schema)
    assert_idle(worker)


def test_logprobs_of_a_constrained_answer_are_finite(worker: ServerProcess) -> None:
    """The grammar masks the logits before sampling; logprobs are the model's own, read
    before the mask, so neither the chosen token nor an alternative is -inf."""
    schema = random_schemas(1, seed=24)[0]
    body = chat(
        worker, response_format=schema_format(schema), logprobs=True, top_logprobs=3, seed=2
    )
    choice = body["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    entries = choice["logprobs"]["content"]
    assert len(entries) == body["usage"]["completion_tokens"]
    for entry in entries:
        assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 3
        assert all(math.isfinite(top["logprob"]) for top in entry["top_logprobs"])
    # a forced tool call: the calls replace the content, the logprobs stay those of its tokens
    tools = [tool("f", schema)]
    named = {"type": "function", "function": {"name": "f"}}
    body = chat(worker, tools=tools, tool_choice=named, logprobs=True, seed=3)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
    entries = choice["logprobs"]["content"]
    assert len(entries) == body["usage"]["completion_tokens"]
    assert all(math.isfinite(e["logprob"]) for e in entries)
    assert_idle(worker)


def test_streamed_n_with_logprobs_and_a_schema(worker: ServerProcess) -> None:
    schema = random_schemas(1, seed=25)[0]
    body = {
        "model": served_model(worker),
        "messages": MESSAGES,
        "max_tokens": 400,
        "n": 2,
        "seed": 11,
        "logprobs": True,
        "response_format": schema_format(schema),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with api(worker) as client:
        chunks = sse_chunks(client.post("/v1/chat/completions", json=body))
    texts = {0: "", 1: ""}
    num_logprobs = {0: 0, 1: 0}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
            for entry in (choice["logprobs"] or {}).get("content", []):
                assert math.isfinite(entry["logprob"])
                num_logprobs[choice["index"]] += 1
    assert chunks[-1]["usage"]["completion_tokens"] == sum(num_logprobs.values())
    for index in (0, 1):
        jsonschema.validate(json.loads(texts[index]), schema)
    assert_idle(worker)


def test_completions_best_of_and_echo_keep_the_grammar(worker: ServerProcess) -> None:
    base = {
        "model": served_model(worker),
        "prompt": "JSON:",
        "max_tokens": 200,
        "response_format": {"type": "json_object"},
        "seed": 5,
    }
    with api(worker) as client:
        best = client.post("/v1/completions", json={**base, "n": 2, "best_of": 3})
        echoed = client.post("/v1/completions", json={**base, "echo": True, "logprobs": 1})
    assert best.status_code == 200, best.text
    choices = best.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:
        assert isinstance(json.loads(choice["text"]), dict)
    assert echoed.status_code == 200, echoed.text
    [choice] = echoed.json()["choices"]
    assert choice["text"].startswith("JSON:")
    assert isinstance(json.loads(choice["text"].removeprefix("JSON:")), dict)
    values = choice["logprobs"]["token_logprobs"]
    assert values[0] is None  # the prompt's first token has none
    assert all(math.isfinite(v) for v in values[1:])
    assert_idle(worker)
