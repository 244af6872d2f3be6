"""What the router reads from an OpenAI request body to route it.

The router has no tokenizer, so the prompt is text: the completion prompt, or the chat
messages flattened in order (role, then content, then any tool calls), after the tools
the request offers (chat templates render them first, in the system turn, and they are
part of the prefill). The same conversation flattens to the same prefix, which is all
the approximate index needs.

A ``cache_salt`` keeps a prompt apart from the same prompt under another salt (or none),
as the workers' caches keep it apart: the text starts with a digest of the salt.

A completion with a list of prompts is one request to one worker: it is routed on its
first prompt (the worker serves them all, so a cache hit of the first is a real hit, and
the rest usually share its prefix: eval harnesses batch the same few-shot context), and
its load is the sum of every prompt's. ``n`` choices do not multiply the load: they fork
from their prompt's blocks on the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import xxhash

from kvserve.core.routing.types import RouteQuery
from kvserve.model_folder.chat_request import message_text


def _json_text(value: Any) -> str:
    """Tools and tool calls as compact JSON; "" for what does not serialize."""
    if not value:
        return ""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode() + "\n"
    except TypeError:
        return ""


def salt_key(body: Mapping[str, Any]) -> str:
    """What a salted prompt's text starts with: the salt's digest (fixed length, so
    salts that share a prefix share no text), then a NUL no prompt text starts with;
    "" for no salt or an empty one, so unsalted texts are as before."""
    salt = body.get("cache_salt")
    if not isinstance(salt, str) or not salt:
        return ""
    return xxhash.xxh3_64_hexdigest(salt.encode("utf-8")) + "\x00"


def prompt_text(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        return _json_text(body.get("tools")) + "".join(
            f"{m.get('role', '')}\n{message_text(m.get('content'))}\n"
            f"{_json_text(m.get('tool_calls'))}"
            for m in messages
            if isinstance(m, dict)
        )
    prompts = completion_prompts(body)
    return _text(prompts[0]) if prompts else ""


def completion_prompts(body: Mapping[str, Any]) -> list[str | list[Any]]:
    """A completion's prompts: one (a string or token ids), or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        return []
    if all(isinstance(p, str | list) for p in prompt):
        return list(prompt)
    return [prompt]  # token ids


def _text(prompt: str | list[Any]) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(str(t) for t in prompt)


def prefill_estimate(body: Mapping[str, Any], text: str, chars_per_token: float) -> int:
    """Prompt tokens the worker will compute: token ids counted, text estimated."""
    prompts = completion_prompts(body) if "messages" not in body else []
    if not prompts:
        return max(1, round(len(text) / chars_per_token))
    return max(
        1,
        sum(round(len(p) / chars_per_token) if isinstance(p, str) else len(p) for p in prompts),
    )


def build_route_query(
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    session_header: str,
    chars_per_token: float,
) -> RouteQuery:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and "messages" not in body:  # the usual completion: shortcut
        text, prefill_tokens = prompt, max(1, round(len(prompt) / chars_per_token))
    else:
        text = prompt_text(body)
        prefill_tokens = prefill_estimate(body, text, chars_per_token)
    user = body.get("user")
    session_key = headers.get(session_header) or (user if isinstance(user, str) else None)
    model = body.get("model")
    return RouteQuery(
        text=salt_key(body) + text,
        model=model if isinstance(model, str) else "",
        session_key=session_key or None,
        prefill_tokens=prefill_tokens,
        body=body,
    )
