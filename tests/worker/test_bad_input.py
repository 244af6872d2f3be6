"""Bad input is a 4xx with OpenAI's error body naming the parameter: never a 5xx or a hang."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvserve.router.local_fleet import ServerProcess
from tests.worker.worker_process import API_KEY, api, served_model


def valid(worker: ServerProcess, **changes: Any) -> dict[str, Any]:
    """A valid completion body with ``changes``; a change to ``...`` drops the field."""
    body: dict[str, Any] = {"model": served_model(worker), "prompt": "hello", "max_tokens": 2}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]
    return error


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 1e9}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": "2"}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [[1, 2], "a"]}, "prompt"),
        ({"prompt": ["a"] * 257}, "prompt"),
        ({"prompt": ["a"] * 100, "n": 3}, "n"),
        ({"prompt": ["a", "b", "c"], "best_of": 100}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        ({"seed": 2**70}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ""}, "stop"),
        ({"stop": [1, 2]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": [1, 2**40]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [10**6]}, "prompt"),
        ({"model": ...}, "model"),
        ({"model": 7}, "model"),
    ],
)
def test_invalid_completion_parameter_is_named(
    worker: ServerProcess, changes: dict[str, Any], param: str
) -> None:
    with api(worker) as client:
        response = client.post("/v1/completions", json=valid(worker, **changes))
    error = assert_error(response, 400, param)
    assert error["type"] == "invalid_request_error"


def test_prompt_beyond_the_context_is_refused(worker: ServerProcess) -> None:
    with api(worker) as client:
        max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
        body = valid(worker, prompt=[3] * (max_model_len + 10))
        response = client.post("/v1/completions", json=body)
    assert_error(response, 400, "prompt")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "wizard", "content": "hi"}], "messages"),
        ([{"role": "user"}], "messages"),
        ([{"role": "user", "content": [{"type": "image_url", "url": "x"}]}], "messages"),
        ([{"role": "user", "content": "hi", "cache_control": {}}], "messages"),
        ([{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}], "messages"),
        ([{"role": "assistant", "content": "a", "tool_calls": [{"id": "1"}]}], "messages"),
    ],
)
def test_invalid_chat_messages_are_named(worker: ServerProcess, messages: Any, param: str) -> None:
    body = valid(worker, messages=messages, prompt=...)
    with api(worker) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert_error(response, 400, param)


def test_unknown_model_is_404_model_not_found(worker: ServerProcess) -> None:
    with api(worker) as client:
        response = client.post("/v1/completions", json=valid(worker, model="gpt-17"))
    assert assert_error(response, 404, "model")["code"] == "model_not_found"


@pytest.mark.parametrize(
    "raw", [b'{"model": ', b"not json", b"[1, 2]", b"", b'{"model": "x", "prompt": "\xff"}']
)
def test_malformed_body_is_400(worker: ServerProcess, raw: bytes) -> None:
    with api(worker) as client:
        response = client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_json_body_declared_as_another_media_type_is_400(
    worker: ServerProcess, content_type: str
) -> None:
    """As FastAPI reads bodies: only JSON media types (or none declared) are parsed."""
    with api(worker) as client:
        raw = httpx.Request("POST", "/", json=valid(worker)).content
        refused = client.post(
            "/v1/completions", content=raw, headers={"content-type": content_type}
        )
        served = client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/vnd.api+json"}
        )
    assert_error(refused, 400, None)
    assert served.status_code == 200, served.text


def test_fifty_megabyte_body_is_413(worker: ServerProcess) -> None:
    huge = b'{"prompt": "' + b"a" * (50 * 1024 * 1024) + b'"}'
    with api(worker) as client:
        response = client.post(
            "/v1/completions", content=huge, headers={"content-type": "application/json"}
        )
    assert_error(response, 413, None)


def test_chunked_body_over_the_limit_is_413(worker: ServerProcess) -> None:
    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    with api(worker) as client:
        response = client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert_error(response, 413, None)


def test_missing_or_wrong_api_key_is_401(worker: ServerProcess) -> None:
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": API_KEY}):
        response = httpx.post(f"{worker.url}/v1/completions", json=valid(worker), headers=headers)
        assert assert_error(response, 401, None)["code"] == "invalid_api_key"


def test_unknown_route_and_method(worker: ServerProcess) -> None:
    with api(worker) as client:
        assert_error(client.get("/v1/nothing"), 404, None)
        assert_error(client.get("/v1/completions"), 405, None)


def test_worker_still_serves_after_bad_input(worker: ServerProcess) -> None:
    with api(worker) as client:
        assert client.post("/v1/completions", json=valid(worker)).status_code == 200
        assert client.get("/debug/check").json() == {"ok": True}


@pytest.mark.parametrize(
    ("changes", "param", "code"),
    [
        ({"frobnicate": 1}, "frobnicate", "invalid_value"),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"function_call": "auto"}, "function_call", "unsupported_parameter"),
        ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
        ({"frequency_penalty": -1.0}, "frequency_penalty", "unsupported_parameter"),
        ({"logit_bias": {"5": 100}}, "logit_bias", "unsupported_parameter"),
        ({"suffix": "end"}, "suffix", "invalid_value"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_field_the_worker_does_not_honour_is_named(
    worker: ServerProcess, route: str, changes: dict[str, Any], param: str, code: str
) -> None:
    """Never silence: a client asking for something the worker would not do is told."""
    if route.endswith("chat/completions"):
        body = valid(worker, prompt=..., messages=[{"role": "user", "content": "hi"}], **changes)
    else:
        body = valid(worker, **changes)
    with api(worker) as client:
        response = client.post(route, json=body)
    error = assert_error(response, 400, param)
    assert error["code"] == code
    assert param in error["message"]


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ],
)
def test_tools_on_completions_are_named(
    worker: ServerProcess, changes: dict[str, Any], param: str
) -> None:
    """Chat serves tools; the completions API has none, so they are refused there."""
    with api(worker) as client:
        response = client.post("/v1/completions", json=valid(worker, **changes))
    assert assert_error(response, 400, param)["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    ("changes", "path"),
    [
        ({"response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
        ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools.0.x"),
    ],
)
def test_an_unknown_field_inside_a_structured_field_is_named(
    worker: ServerProcess, changes: dict[str, Any], path: str
) -> None:
    """OpenAI's ``param`` is the top-level field; the message has the full path."""
    body = valid(worker, prompt=..., messages=[{"role": "user", "content": "hi"}], **changes)
    with api(worker) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert path in assert_error(response, 400, path.split(".")[0])["message"]


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True}, "echo"),
    ],
)
def test_invalid_chat_parameter_is_named(
    worker: ServerProcess, changes: dict[str, Any], param: str
) -> None:
    body = valid(worker, prompt=..., messages=[{"role": "user", "content": "hi"}], **changes)
    with api(worker) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert_error(response, 400, param)


def test_an_assistant_message_replayed_with_null_fields_is_served(worker: ServerProcess) -> None:
    """What the openai SDK dumps of a response message: the fields it leaves null."""
    replayed = {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None}
    messages = [{"role": "user", "content": "hi", "name": "ann"}, replayed]
    messages.append({"role": "user", "content": "again"})
    body = valid(worker, prompt=..., messages=messages)
    with api(worker) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
