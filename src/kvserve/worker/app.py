"""The worker's ASGI app: OpenAI routes, health, load, metrics, KV events, debug.

The engine is built before the app (loading weights can take long and can fail; that
should happen before the port opens); the app's lifespan starts and stops the engine
thread around serving.

Every request passes through a few plain ASGI layers (worker header, API key, body
limit, the generation routes) before FastAPI's own middleware stack and router, which
only the other routes reach: FastAPI's layers cost more per request than the worker's
own work for a short generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from typing import Any

from fastapi import FastAPI
from starlette.responses import Response
from starlette.types import ASGIApp

from kvserve.core.invariants import InvariantError
from kvserve.worker.api_key import APIKeyMiddleware
from kvserve.worker.body_limit import BodyLimitMiddleware
from kvserve.worker.config import WorkerConfig
from kvserve.worker.debug_check import CheckBudget, CheckRefused
from kvserve.worker.engine_bridge import EngineBridge
from kvserve.worker.engine_state import probe_engine
from kvserve.worker.errors import APIError, install_error_handlers
from kvserve.worker.events import build_events_router
from kvserve.worker.json_response import JSONResponse
from kvserve.worker.metrics import WorkerMetrics
from kvserve.worker.openai_api import GenerationRoutes, OpenAIEndpoints, build_openai_router
from kvserve.worker.pd_api import PDService
from kvserve.worker.vllm_kv_publisher import VllmKVPublisher
from kvserve.worker.worker_header import WorkerHeaderMiddleware


def build_app(config: WorkerConfig, engine: Any) -> ASGIApp:
    """An app serving ``engine`` (an ``LLMEngine``), which it then owns."""
    bridge = EngineBridge(engine, probe_engine)
    metrics = WorkerMetrics(lambda: bridge.state)
    worker_id = config.resolved_worker_id
    pd = PDService(config, bridge, metrics) if config.role != "mixed" else None
    instance = uuid.uuid4().hex  # a router sees a new one when this worker restarted

    if config.kv_events_publisher is not None:
        engine.events.record_tokens = True  # BlockStored carries the blocks' tokens
    publisher = (
        VllmKVPublisher(
            bridge,
            config.kv_events_publisher,
            config.block_size,
            replay_endpoint=config.kv_events_replay,
        )
        if config.kv_events_publisher is not None
        else None
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if publisher is not None:
            publisher.open()  # a taken port fails the start here
        bridge.start()
        publishing = asyncio.create_task(publisher.run()) if publisher else None
        try:
            async with pd.serving() if pd else nullcontext():
                yield
        finally:
            if publishing is not None:
                publishing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await publishing
            if publisher is not None:
                publisher.close()
            await bridge.shutdown()

    app = FastAPI(title="kvserve worker", lifespan=lifespan, default_response_class=JSONResponse)
    app.state.bridge = bridge
    install_error_handlers(app)
    endpoints = OpenAIEndpoints(bridge, metrics)
    app.include_router(build_openai_router(endpoints))
    app.include_router(build_events_router(bridge, config.block_size))
    if pd:
        app.include_router(pd.router)

    @app.get("/health")
    async def health() -> Response:
        if not bridge.is_running():
            raise APIError(503, "The engine thread is not running.")
        return JSONResponse(
            {
                "status": "ok",
                "worker_id": worker_id,
                "role": config.role,
                "model": endpoints.model_name,
                "instance": instance,
            }
        )

    @app.get("/load")
    async def load() -> Response:
        return JSONResponse({"worker_id": worker_id, "role": config.role, **bridge.state.load()})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    check_budget = CheckBudget(time.monotonic)

    @app.get("/debug/check")
    async def check_ledger() -> Response:
        """Runs the block ledger's and the connectors' invariant checks between two steps,
        within the check budget (see :mod:`kvserve.worker.debug_check`)."""

        async def check() -> None:
            await bridge.call(lambda e: e.check())

        try:
            await check_budget.run(check)
        except CheckRefused as refused:
            body = APIError(429, str(refused), code="check_rate_limited").body()
            retry_after = str(max(1, math.ceil(refused.retry_after_s)))
            return JSONResponse(body, status_code=429, headers={"Retry-After": retry_after})
        except InvariantError as exc:
            raise APIError(500, f"KV cache invariant broken: {exc}", code="ledger_broken") from exc
        return JSONResponse({"ok": True})

    served: ASGIApp = BodyLimitMiddleware(
        GenerationRoutes(app, endpoints),
        config.max_body_bytes,
        config.client_limits.body_timeout_s,
    )
    if config.api_key is not None:
        served = APIKeyMiddleware(
            served, config.api_key, metrics_without_key=config.metrics_without_key
        )
    return WorkerHeaderMiddleware(served, worker_id)
