"""A prefill or decode worker's PD endpoints and background services.

- ``GET /pd/info``: the worker's role, KV layout and (prefill role) KV transfer address.
- ``POST /pd/v1/completions``, ``POST /pd/v1/chat/completions`` (decode role): the OpenAI
  body as a router received it, plus ``x-kvserve-prefill: URL`` naming the prefill worker
  (absent: prefill here). Answers like ``/v1/...``, with ``x-kvserve-pd`` saying how the
  prompt was prefilled (``remote``, ``local``, ``fallback``).

While serving, a prefill worker's KV transfer sender accepts transfers; a decode worker
sweeps lapsed leases every second, so blocks of a reservation nobody finishes come back
even when the engine is idle. The engine was built with the role's PD connector
(:func:`pd_connectors`); the transfer is the built-in TCP one or, with
``--kv-transfer mooncake``, the Mooncake Transfer Engine (:func:`transfer_sender`,
:func:`transfer_receiver`: where an implementation plugs in).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from starlette.responses import Response

from kvserve.engine.kv_connector import ConnectorFactory
from kvserve.engine.pd_export import PDExporter
from kvserve.engine.pd_import import PDImporter, pd_importer
from kvserve.worker.config import WorkerConfig
from kvserve.worker.engine_bridge import EngineBridge
from kvserve.worker.json_response import JSONResponse
from kvserve.worker.kv_transfer import EngineExports, KVTransferReceiver, KVTransferSender
from kvserve.worker.metrics import WorkerMetrics
from kvserve.worker.openai_api import OpenAIEndpoints
from kvserve.worker.pd_decode import PDDecodeSession
from kvserve.worker.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.worker.tcp_kv_transfer import TCPKVReceiver, TCPKVSender

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

PREFILL_HEADER = "x-kvserve-prefill"
PATH_HEADER = "x-kvserve-pd"
LEASE_SWEEP_INTERVAL_S = 1.0


def pd_connectors(config: WorkerConfig) -> list[ConnectorFactory]:
    """The PD connector of the worker's role (none for a mixed worker)."""
    if config.role == "prefill":
        return [PDExporter]
    if config.role == "decode":
        return [pd_importer(config.pd)]
    return []


def transfer_sender(
    config: WorkerConfig, bridge: EngineBridge, exporter: PDExporter
) -> KVTransferSender:
    """A prefill worker's side of the KV transfer."""
    if config.kv_transfer == "mooncake":
        from kvserve.worker.mooncake_kv_transfer import MooncakeEngine, MooncakeKVSender

        engine = MooncakeEngine(config.host)
        return MooncakeKVSender(EngineExports(bridge), exporter.layout, config.host, engine)
    same_host_shm = config.kv_transfer_same_host == "shm"
    return TCPKVSender(
        EngineExports(bridge), exporter.layout, config.host, same_host_shm=same_host_shm
    )


def transfer_receiver(config: WorkerConfig, importer: PDImporter) -> KVTransferReceiver:
    """A decode worker's side of the KV transfer."""
    # A prefill worker silent for a lease's lifetime would lose the lease anyway.
    timeout_s = importer.lease_ttl_s
    if config.kv_transfer == "mooncake":
        from kvserve.worker.mooncake_kv_transfer import MooncakeEngine, MooncakeKVReceiver

        engine = MooncakeEngine(config.host)
        return MooncakeKVReceiver(importer.layout, engine, timeout_s, api_key=config.api_key)
    same_host_shm = config.kv_transfer_same_host == "shm"
    return TCPKVReceiver(
        importer.layout,
        timeout_s,
        api_key=config.api_key,
        same_host_shm=same_host_shm,
        max_transfer_blocks=importer.max_transfer_blocks,
    )


class PDService:
    def __init__(self, config: WorkerConfig, bridge: EngineBridge, metrics: WorkerMetrics) -> None:
        self._config = config
        self._bridge = bridge
        self._metrics = metrics
        engine: LLMEngine = bridge.engine
        self._sender: KVTransferSender | None = None
        self._receiver: KVTransferReceiver | None = None
        if config.role == "prefill":
            exporter = engine.connector(PDExporter)
            self._layout = exporter.layout
            self._sender = transfer_sender(config, bridge, exporter)
        else:
            self._importer = engine.connector(PDImporter)  # used on the engine thread only
            self._layout = self._importer.layout
            self._receiver = transfer_receiver(config, self._importer)
        self.router = self._build_router()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        if self._sender is not None:
            await self._sender.start()
            try:
                yield
            finally:
                await self._sender.close()
            return
        assert self._receiver is not None, "decode role"
        await self._receiver.start()
        sweeper = asyncio.ensure_future(self._sweep_leases())
        try:
            yield
        finally:
            sweeper.cancel()
            self._receiver.close()

    async def _sweep_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SWEEP_INTERVAL_S)
            self._bridge.post(self._expire_leases)

    def _expire_leases(self, _: LLMEngine) -> None:
        self._importer.expire(time.monotonic())

    async def _respond(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
    ) -> Response:
        """As the ``/v1`` route would, with the PD session in the engine's place (one
        engine request, so one choice, per HTTP request)."""
        prefill_url = request.headers.get(PREFILL_HEADER) or None
        assert self._receiver is not None, "decode role only"
        session = PDDecodeSession(
            self._bridge, self._importer, self._receiver, prefill_url, request.receive
        )
        endpoints = OpenAIEndpoints(session, self._metrics, single_choice=True)
        if isinstance(body, ChatCompletionRequest):
            response = await endpoints.chat_completion(request, body)
        else:
            response = await endpoints.completion(request, body)
        response.headers[PATH_HEADER] = session.path
        return response

    def _build_router(self) -> APIRouter:
        router = APIRouter()
        config = self._config

        @router.get("/pd/info")
        async def info() -> Response:
            body = {"role": config.role, "layout": self._layout.to_json()}
            if self._sender is not None:
                body |= self._sender.info()
            return JSONResponse(body)

        if config.role != "decode":
            return router

        @router.post("/pd/v1/completions")
        async def completion(request: Request, body: CompletionRequest) -> Response:
            return await self._respond(request, body)

        @router.post("/pd/v1/chat/completions")
        async def chat_completion(request: Request, body: ChatCompletionRequest) -> Response:
            return await self._respond(request, body)

        return router
