"""Error responses in OpenAI's shape, so clients' SDKs report them properly."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web


def openai_error(
    status: int,
    message: str,
    *,
    error_type: str,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """``headers`` may be those gathered for an answer that then failed (the worker's
    content type included): the error body is JSON whatever they said."""
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    kept = {k: v for k, v in (headers or {}).items() if k.lower() != "content-type"}
    return web.Response(
        status=status,
        body=orjson.dumps(body),
        content_type="application/json",
        headers=kept,
    )
