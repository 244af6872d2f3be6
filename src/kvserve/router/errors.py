"""Error responses in OpenAI's shape, so clients' SDKs report them properly."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

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


@web.middleware
async def unknown_routes_as_openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A path the router does not serve (404) or a method it does not take there (405),
    answered in OpenAI's error shape rather than aiohttp's plain text: an SDK pointed at
    the router (a ``/v1/embeddings`` call, say) then reports what went wrong. Only
    routing failures: a handler's own 404 (an unknown worker) keeps its body."""
    failure = request.match_info.http_exception
    if failure is None:
        return await handler(request)
    where = f"{request.method} {request.path}"
    if isinstance(failure, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(failure.allowed_methods))
        return openai_error(
            405,
            f"Method not allowed ({where}); this path takes {allowed}.",
            error_type="invalid_request_error",
            code="method_not_allowed",
            headers={"Allow": allowed},
        )
    return openai_error(
        failure.status,
        f"Invalid URL ({where}): the router serves POST /v1/chat/completions, "
        "POST /v1/completions and GET /v1/models.",
        error_type="invalid_request_error",
        code="unknown_url",
    )
