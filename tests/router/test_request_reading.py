"""What the router reads from requests (prompt, session key) and responses (cached tokens)."""

from __future__ import annotations

import random

import orjson
import pytest

from kvserve.router.config import RetryConfig
from kvserve.router.retry import backoff_delays
from kvserve.router.route_query import build_route_query, prompt_text
from kvserve.router.usage import StreamUsageReader, cached_tokens_in_body


def test_chat_messages_flatten_in_order_with_roles() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]},
        ]
    }
    assert prompt_text(body) == "system\nBe brief.\nuser\nHi\n"


def test_tools_and_tool_calls_count_in_a_chat_prompt() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {
        "tools": tools,
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
        ],
    }
    text = prompt_text(body)
    assert text.startswith('[{"function":{"name":"f","parameters":{"type":"object"}}')
    assert text.endswith(
        'user\nHi\nassistant\n\n[{"function":{"arguments":"{}","name":"f"},'
        '"id":"c","type":"function"}]\ntool\nok\n'
    )
    # without tools, as before
    assert prompt_text({"messages": body["messages"][:1]}) == "user\nHi\n"


@pytest.mark.parametrize(
    ("prompt", "text"),
    [
        ("plain", "plain"),
        (["a", "b"], "a"),
        ([1, 2, 3], "1\n2\n3"),
        ([[1, 2], [3]], "1\n2"),
        (None, ""),
        ([], ""),
    ],
)
def test_completion_prompts_of_every_shape_route_on_the_first(prompt: object, text: str) -> None:
    assert prompt_text({"prompt": prompt}) == text


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [("x" * 400, 100), (["x" * 400, "y" * 40], 110), ([5] * 30, 30), ([[5] * 30, [6] * 7], 37)],
)
def test_a_list_of_prompts_loads_the_worker_with_their_sum(prompt: object, tokens: int) -> None:
    """One request, one worker: its load is every prompt's, and n does not multiply it."""
    body = {"prompt": prompt, "model": "m", "n": 4}
    query = build_route_query(body, {}, session_header="h", chars_per_token=4)
    assert query.prefill_tokens == tokens


def test_session_key_from_header_then_user_field() -> None:
    def key(body: dict[str, object], headers: dict[str, str]) -> str | None:
        return build_route_query(
            body, headers, session_header="x-session-id", chars_per_token=4
        ).session_key

    assert key({"user": "alice"}, {"x-session-id": "s1"}) == "s1"
    assert key({"user": "alice"}, {}) == "alice"
    assert key({"user": 7}, {}) is None


def test_prefill_estimate_is_characters_over_four() -> None:
    query = build_route_query(
        {"prompt": "x" * 400, "model": "m"}, {}, session_header="h", chars_per_token=4
    )
    assert (query.prefill_tokens, query.model, query.pool) == (100, "m", "regular")


def test_cached_tokens_from_a_json_body() -> None:
    body = {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}}
    assert cached_tokens_in_body(orjson.dumps(body)) == 8
    assert cached_tokens_in_body(b'{"usage": null}') is None
    assert cached_tokens_in_body(b"not json") is None


def test_cached_tokens_from_a_stream_split_anywhere() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 48}}}
    stream = (
        b'data: {"choices": [{"text": "a"}], "usage": null}\n\n'
        + b"data: "
        + orjson.dumps(usage)
        + b"\n\ndata: [DONE]\n\n"
    )
    for cut in range(0, len(stream), 7):
        reader = StreamUsageReader()
        for start in range(0, len(stream), cut or len(stream)):
            reader.feed(stream[start : start + (cut or len(stream))])
        assert reader.cached_tokens == 48


def test_backoff_grows_is_capped_and_stops_after_max_retries() -> None:
    config = RetryConfig(max_retries=4, initial_backoff_s=1.0, max_backoff_s=2.0, jitter=0.0)
    assert list(backoff_delays(config, random.Random(0))) == [1.0, 1.5, 2.0, 2.0]
