"""The worker's API key, enforced in one place for every route but ``/health``.

A plain ASGI layer in front of the whole app (the generation routes included): one
header lookup and one constant-time comparison of bytes per request, so the generation
hot path pays next to nothing. ``/health`` stays open for load balancers and the
router's health checker; ``/metrics`` too when asked (``--metrics-without-key``), for a
Prometheus scraper that holds no credentials. Workers of one fleet share one key: a PD
decode worker sends its own key to its prefill peer.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.worker.errors import APIError

_AUTHORIZATION = b"authorization"


class APIKeyMiddleware:
    """Refuses a missing or wrong ``Authorization: Bearer KEY`` with OpenAI's 401 body."""

    def __init__(self, app: ASGIApp, api_key: str, *, metrics_without_key: bool) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode("latin-1")
        self._open_paths = frozenset(
            {"/health", "/metrics"} if metrics_without_key else {"/health"}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Invalid or missing API key.", code="invalid_api_key")
        await error.response()(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == _AUTHORIZATION), b"")
        return hmac.compare_digest(given, self._expected)
