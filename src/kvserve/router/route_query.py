"""What the router reads from an OpenAI request body to route it.

The router has no tokenizer, so the prompt is text: the completion prompt, or the chat
messages flattened in order (role, then content, then any tool calls), after the tools
the request offers (chat templates render them first, in the system turn, and they are
part of the prefill). The same conversation flattens to the same prefix, which is all
the approximate index needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from kvserve.core.routing.types import RouteQuery


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: keep the text parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _json_text(value: Any) -> str:
    """Tools and tool calls as compact JSON; "" for what does not serialize."""
    if not value:
        return ""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode() + "\n"
    except TypeError:
        return ""


def prompt_text(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        return _json_text(body.get("tools")) + "".join(
            f"{m.get('role', '')}\n{_content_text(m.get('content'))}\n"
            f"{_json_text(m.get('tool_calls'))}"
            for m in messages
            if isinstance(m, dict)
        )
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # a batch of strings, or token ids
        return "\n".join(p if isinstance(p, str) else str(p) for p in prompt)
    return ""


def build_route_query(
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    session_header: str,
    chars_per_token: float,
) -> RouteQuery:
    text = prompt_text(body)
    user = body.get("user")
    session_key = headers.get(session_header) or (user if isinstance(user, str) else None)
    model = body.get("model")
    return RouteQuery(
        text=text,
        model=model if isinstance(model, str) else "",
        session_key=session_key or None,
        prefill_tokens=max(1, round(len(text) / chars_per_token)),
        body=body,
    )
