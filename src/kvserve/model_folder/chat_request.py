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
    """Role and text, plus the sender's ``name``, an assistant's ``tool_calls`` and a
    tool result's ``tool_call_id`` (templates may render each), in one normal form."""
    out: dict[str, Any] = {
        "role": message.get("role"),
        "content": message_text(message.get("content")),
    }
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [_template_call(call) for call in calls if isinstance(call, dict)]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    return out


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The tools a template renders, in one normal form (type, then the function's name,
    description and parameters where given); None if there are none."""
    if not isinstance(tools, list) or not tools:
        return None
    return [_template_tool(tool) for tool in tools if isinstance(tool, dict)] or None


def _template_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    function = function if isinstance(function, dict) else {}
    return {
        "id": call.get("id"),
        "type": call.get("type", "function"),
        "function": {"name": function.get("name"), "arguments": function.get("arguments")},
    }


def _template_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    function = function if isinstance(function, dict) else {}
    fields = ("name", "description", "parameters")
    spec = {key: function[key] for key in fields if function.get(key) is not None}
    return {"type": tool.get("type"), "function": spec}
