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

    def __init__(self, body: bytes, status: int) -> None:
        self.body, self.status, self.hits = body, status, 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        async def metrics(_request: web.Request) -> web.Response:
            self.hits += 1
            return web.Response(status=self.status, body=self.body, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


class _Fleet:
    """Workers behind real ``/metrics`` servers, and a sampler on a clock the test moves."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.registry = WorkerRegistry(CircuitBreakerConfig())
        self.servers: list[_MetricsServer] = []
        self.now = 0.0
        self.sampler = FleetSampler(self.registry, RouterMetrics(), session, clock=lambda: self.now)

    async def add(self, body: bytes, status: int = 200) -> tuple[_MetricsServer, str]:
        """A started server and its worker's id."""
        server = _MetricsServer(body, status)
        self.servers.append(server)
        await server.start()
        return server, self.registry.add(server.url).worker_id

    async def sample_at(self, now: float) -> None:
        self.now = now
        await self.sampler.sample()


@pytest.fixture
async def fleet() -> AsyncIterator[_Fleet]:
    async with aiohttp.ClientSession() as session:
        built = _Fleet(session)
        try:
            yield built
        finally:
            for server in built.servers:
                await server.stop()


async def test_a_foreign_worker_is_asked_once_a_minute(fleet: _Fleet) -> None:
    kvserve, ours = await fleet.add(KVSERVE_EXPOSITION)
    vllm, theirs = await fleet.add(VLLM_EXPOSITION)
    for second in range(5):
        await fleet.sample_at(100.0 + second)
    assert (kvserve.hits, vllm.hits) == (5, 1)
    assert set(fleet.sampler.reports) == {ours}
    assert theirs not in fleet.sampler.reports

    await fleet.sample_at(100.0 + FOREIGN_RETRY_S)  # a minute after the foreign answer
    assert (kvserve.hits, vllm.hits) == (6, 2)


async def test_a_worker_that_turns_kvserve_is_read_and_asked_every_interval(
    fleet: _Fleet,
) -> None:
    server, worker_id = await fleet.add(VLLM_EXPOSITION)
    await fleet.sample_at(0.0)
    server.body = KVSERVE_EXPOSITION
    await fleet.sample_at(FOREIGN_RETRY_S)
    assert worker_id in fleet.sampler.reports
    await fleet.sample_at(FOREIGN_RETRY_S + 1.0)
    assert server.hits == 3


async def test_a_worker_that_failed_to_answer_is_asked_next_interval(fleet: _Fleet) -> None:
    server, worker_id = await fleet.add(KVSERVE_EXPOSITION, status=503)
    await fleet.sample_at(0.0)
    assert fleet.sampler.reports == {}
    server.status = 200
    await fleet.sample_at(1.0)
    assert set(fleet.sampler.reports) == {worker_id} and server.hits == 2
