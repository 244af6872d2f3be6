"""A prefill or decode worker's PD endpoints and background services.

- ``GET /pd/info``: the worker's role, KV layout and (prefill role) KV transfer address.
- ``POST /pd/v1/completions``, ``POST /pd/v1/chat/completions`` (decode role): the OpenAI
  body as a router received it, plus ``x-kvserve-prefill: URL`` naming the prefill worker
  (absent: prefill here). Answers like ``/v1/...``, with ``x-kvserve-pd`` saying how the
  prompt was prefilled (``remote``, ``local``, ``fallback``).

While serving, a prefill worker listens for KV transfers; a decode worker sweeps lapsed
leases every second, so blocks of a reservation nobody finishes come back even when the
engine is idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from starlette.responses import Response

from kvserve.worker.async_engine import AsyncEngine
from kvserve.worker.config import WorkerConfig
from kvserve.worker.json_response import JSONResponse
from kvserve.worker.metrics import WorkerMetrics
from kvserve.worker.openai_api import OpenAIEndpoints
from kvserve.worker.pd_decode import PDDecodeSession, PrefillPeers
from kvserve.worker.pd_transfer import PrefillTransferServer
from kvserve.worker.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from kvserve.worker.responses import CHAT, COMPLETION, ResponseFormat

PREFILL_HEADER = "x-kvserve-prefill"
PATH_HEADER = "x-kvserve-pd"
LEASE_SWEEP_INTERVAL_S = 1.0


class PDService:
    def __init__(self, config: WorkerConfig, bridge: AsyncEngine, metrics: WorkerMetrics) -> None:
        self._config = config
        self._bridge = bridge
        self._metrics = metrics
        self._peers = PrefillPeers(timeout_s=5.0)
        self._transfer = PrefillTransferServer(bridge, bridge.engine.kv_layout)
        self.router = self._build_router()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        if self._config.role == "prefill":
            await self._transfer.start(self._config.host)
            try:
                yield
            finally:
                await self._transfer.close()
            return
        sweeper = asyncio.ensure_future(self._sweep_leases())
        try:
            yield
        finally:
            sweeper.cancel()

    async def _sweep_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SWEEP_INTERVAL_S)
            self._bridge.post(lambda engine: engine.expire_leases(time.monotonic()))

    async def _respond(
        self,
        request: Request,
        body: SamplingRequest,
        fmt: ResponseFormat,
        prompt_of: Callable[[OpenAIEndpoints], str | list[int]],
        max_tokens: int | None,
    ) -> Response:
        """As the ``/v1`` route would, with the PD session in the engine's place."""
        prefill_url = request.headers.get(PREFILL_HEADER) or None
        session = PDDecodeSession(self._bridge, self._peers, prefill_url, request.receive)
        endpoints = OpenAIEndpoints(session, self._metrics, self._config.api_key)  # type: ignore[arg-type]
        await endpoints.check_api_key(request)
        endpoints.check_model(body)
        response = await endpoints.generate(request, body, fmt, prompt_of(endpoints), max_tokens)
        response.headers[PATH_HEADER] = session.path
        return response

    def _build_router(self) -> APIRouter:
        router = APIRouter()
        config, engine = self._config, self._bridge.engine

        @router.get("/pd/info")
        async def info() -> Response:
            body = {"role": config.role, "layout": engine.kv_layout.to_json()}
            if config.role == "prefill":
                body |= {"transfer_host": config.host, "transfer_port": self._transfer.port}
            return JSONResponse(body)

        if config.role != "decode":
            return router

        @router.post("/pd/v1/completions")
        async def completion(request: Request, body: CompletionRequest) -> Response:
            max_tokens = body.max_tokens if body.max_tokens is not None else 16
            return await self._respond(request, body, COMPLETION, lambda _: body.prompt, max_tokens)

        @router.post("/pd/v1/chat/completions")
        async def chat_completion(request: Request, body: ChatCompletionRequest) -> Response:
            return await self._respond(
                request, body, CHAT, lambda e: e.chat_prompt(body), body.requested_max_tokens()
            )

        return router
