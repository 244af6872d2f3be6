"""A chat request's messages and tools as a chat template reads them.

The worker renders its prompt from these and the router hashes the same rendering
(kv_aware), so both build the template's input with this one function: any difference
would make the router's view of a worker's cache wrong for tool conversations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def message_text(content: Any) -> str:
    """A message's content as text: a string, the text parts of a list, or nothing."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Role and text, plus an assistant's ``tool_calls`` and a tool result's
    ``tool_call_id`` as the client sent them (templates render past calls from these)."""
    out: dict[str, Any] = {
        "role": message.get("role"),
        "content": message_text(message.get("content")),
    }
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    return out


def template_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools a template renders: the request's ``tools`` list as sent, None if none."""
    tools = body.get("tools")
    return tools if isinstance(tools, list) and tools else None
