"""The template's input is one normal form whichever side builds it: the router from the
raw JSON body, the worker from its validated body. A difference would make the router's
hashes of a tool conversation miss the worker's cached blocks."""

from __future__ import annotations

from typing import Any

from kvserve.model_folder.chat_request import template_message, template_tools
from kvserve.worker.protocol import ChatCompletionRequest

RAW: dict[str, Any] = {
    "model": "m",
    "tools": [
        {
            # keys in another order, a null, a field templates do not read
            "function": {"parameters": {"type": "object"}, "name": "f", "description": None,
                         "strict": True},
            "type": "function",
        }
    ],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "refusal": None,  # as the openai SDK replays it
            "tool_calls": [{"type": "function", "id": "c1",
                            "function": {"arguments": "{}", "name": "f"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok", "name": None},
        {"role": "user", "content": "thanks", "name": "ann"},
    ],
}  # fmt: skip


def test_router_and_worker_build_the_same_template_input() -> None:
    worker_messages, worker_tools = ChatCompletionRequest.model_validate(RAW).template_input()
    assert worker_messages == [template_message(m) for m in RAW["messages"]]
    assert worker_tools == template_tools(RAW["tools"])
    assert worker_tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert worker_messages[0] == {"role": "user", "content": "ab"}
    assert worker_messages[1]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]
    assert worker_messages[2] == {"role": "tool", "content": "ok", "tool_call_id": "c1"}
    assert worker_messages[3] == {"role": "user", "content": "thanks", "name": "ann"}
    assert template_tools(None) is None and template_tools([]) is None
