"""The dashboard's sampler asks a worker whose ``/metrics`` is another server's only once a
minute, and a kvserve worker every interval: rendering a vLLM exposition costs the vLLM
server's API process time its requests wait for, and none of it is read."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from kvserve.router.circuit_breaker import CircuitBreakerConfig
from kvserve.router.dashboard.sampler import FOREIGN_RETRY_S, FleetSampler
from kvserve.router.metrics import RouterMetrics
from kvserve.router.worker_registry import WorkerRegistry
from kvserve.worker.engine_state import EngineState
from kvserve.worker.metrics import WorkerMetrics

KVSERVE_EXPOSITION = WorkerMetrics(
    lambda: EngineState(
        running=1, waiting=0, free_blocks=10, cached_blocks=5, total_blocks=16,
        prefill_tokens=0, prefix_queried_tokens=0, prefix_hit_tokens=0, preemptions=0,
        kv_tiers=(),
    )
).render()  # fmt: skip
VLLM_EXPOSITION = (
    b"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    b"# TYPE vllm:num_requests_running gauge\n"
    b'vllm:num_requests_running{model_name="m"} 0.0\n'
)


class _MetricsServer:
    """A worker's ``/metrics`` that answers with ``status`` and ``body``, counting asks."""

    def __init__(self, body: bytes, status: int = 200) -> None:
        self.body, self.status, self.hits = body, status, 0
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        async def metrics(_request: web.Request) -> web.Response:
            self.hits += 1
            return web.Response(status=self.status, body=self.body, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def test_a_foreign_worker_is_asked_once_a_minute(session: aiohttp.ClientSession) -> None:
    kvserve, vllm = _MetricsServer(KVSERVE_EXPOSITION), _MetricsServer(VLLM_EXPOSITION)
    registry = WorkerRegistry(CircuitBreakerConfig())
    ours = registry.add(await kvserve.start())
    theirs = registry.add(await vllm.start())
    try:
        clock = [100.0]
        sampler = FleetSampler(registry, RouterMetrics(), session, clock=lambda: clock[0])
        for _ in range(5):
            await sampler.sample()
            clock[0] += 1.0
        assert (kvserve.hits, vllm.hits) == (5, 1)
        assert set(sampler.reports) == {ours.worker_id}
        assert theirs.worker_id not in sampler.reports

        clock[0] = 100.0 + FOREIGN_RETRY_S  # a minute after the foreign answer: asked again
        await sampler.sample()
        assert (kvserve.hits, vllm.hits) == (6, 2)
    finally:
        await kvserve.stop()
        await vllm.stop()


async def test_a_worker_that_turns_kvserve_is_read_and_asked_every_interval(
    session: aiohttp.ClientSession,
) -> None:
    server = _MetricsServer(VLLM_EXPOSITION)
    registry = WorkerRegistry(CircuitBreakerConfig())
    worker = registry.add(await server.start())
    try:
        clock = [0.0]
        sampler = FleetSampler(registry, RouterMetrics(), session, clock=lambda: clock[0])
        await sampler.sample()
        server.body = KVSERVE_EXPOSITION
        clock[0] = FOREIGN_RETRY_S
        await sampler.sample()
        assert worker.worker_id in sampler.reports
        clock[0] += 1.0
        await sampler.sample()
        assert server.hits == 3
    finally:
        await server.stop()


async def test_a_worker_that_failed_to_answer_is_asked_next_interval(
    session: aiohttp.ClientSession,
) -> None:
    server = _MetricsServer(KVSERVE_EXPOSITION, status=503)
    registry = WorkerRegistry(CircuitBreakerConfig())
    worker = registry.add(await server.start())
    try:
        clock = [0.0]
        sampler = FleetSampler(registry, RouterMetrics(), session, clock=lambda: clock[0])
        await sampler.sample()
        assert sampler.reports == {}
        server.status = 200
        clock[0] += 1.0
        await sampler.sample()
        assert set(sampler.reports) == {worker.worker_id} and server.hits == 2
    finally:
        await server.stop()
