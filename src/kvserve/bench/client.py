"""A streaming OpenAI HTTP client that times each chunk.

Any failure — refused connection, an HTTP error, a stream that stops before
``[DONE]``, a timeout — is written into the record as an error, never raised: a bench
must report a misbehaving server, not die of it.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import orjson

from kvserve.bench.metrics import RequestRecord

WORKER_HEADER = "x-kvserve-worker"
DECISION_HEADER = "x-kvserve-decision"  # policy=NAME; reason=...; matched=...
_JSON = {"Content-Type": "application/json"}


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def api_base(endpoint: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` → ``http://host:port/v1``."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


async def first_model(session: aiohttp.ClientSession, endpoint: str) -> str:
    """The first model the endpoint serves, for runs that name none."""
    async with session.get(api_base(endpoint) + "/models") as resp:
        resp.raise_for_status()
        models = (await resp.json())["data"]
    if not models:
        raise RuntimeError(f"{endpoint} serves no models")
    return str(models[0]["id"])


def decision_policy(decision: str | None) -> str | None:
    """The policy a kvserve router names in its decision header; None from other servers."""
    if not decision:
        return None
    for part in decision.split(";"):
        key, _, value = part.strip().partition("=")
        if key == "policy" and value:
            return value
    return None


async def stream_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], record: RequestRecord
) -> str:
    """POST ``body`` with streaming on, fill ``record``'s measurements, return the text.

    TTFT is the time to the first chunk that carries text (a role-only first chunk is
    not a token); inter-token latencies are the gaps between later text chunks.
    """
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    last = started
    pieces: list[str] = []
    chunks = 0
    done = False
    try:
        async with session.post(url, data=orjson.dumps(body), headers=_JSON) as resp:
            record.status = resp.status
            record.worker = resp.headers.get(WORKER_HEADER)
            record.decision = resp.headers.get(DECISION_HEADER)
            record.policy = decision_policy(record.decision)
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {_error_message(await resp.read())}"
                return ""
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                event = orjson.loads(payload)
                if "error" in event:
                    record.error = f"stream error: {_error_message(payload)}"
                    return "".join(pieces)
                _read_usage(event, record)
                text = _chunk_text(event)
                if text:
                    now = time.perf_counter()
                    if record.ttft_s is None:
                        record.ttft_s = now - started
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    chunks += 1
                    pieces.append(text)
        if not done:
            record.error = "stream cut: ended before [DONE]"
    except aiohttp.ClientConnectorError as exc:
        record.error = f"connection failed: {exc}"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        record.error = f"stream cut: {exc or type(exc).__name__}"
    except TimeoutError:
        record.error = "timeout: no complete response within the request timeout"
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: bad JSON, overlong line
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.e2e_s = time.perf_counter() - started
        if not record.completion_tokens:
            record.completion_tokens = chunks
    return "".join(pieces)


def _chunk_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    return (delta.get("content") if delta is not None else choice.get("text")) or ""


def _read_usage(event: dict[str, Any], record: RequestRecord) -> None:
    usage = event.get("usage")
    if not usage:
        return
    record.prompt_tokens = usage.get("prompt_tokens") or 0
    record.completion_tokens = usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens") or 0


def _error_message(body: bytes) -> str:
    """OpenAI's ``{"error": {"message": ...}}`` when present, else the raw body."""
    try:
        parsed = orjson.loads(body)
        error = parsed.get("error") if isinstance(parsed, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        return str(message or parsed)[:300]
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")[:300]
