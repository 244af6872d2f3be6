"""Periodic health checks: a worker that stops answering is skipped until it answers again."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvserve.router.config import HealthCheckConfig
from kvserve.router.metrics import RouterMetrics
from kvserve.router.worker_registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self,
        registry: WorkerRegistry,
        config: HealthCheckConfig,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
    ) -> None:
        self._registry = registry
        self._config = config
        self._metrics = metrics
        self._session = session

    async def probe(self, worker: Worker) -> bool:
        """Check one worker now and record the answer; returns whether it answered OK."""
        try:
            async with self._session.get(
                worker.url + self._config.endpoint,
                timeout=aiohttp.ClientTimeout(total=self._config.timeout_s),
            ) as response:
                ok = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if worker.record_health(ok, self._config):
            log.warning(
                "worker %s (%s) is now %s",
                worker.worker_id,
                worker.url,
                "healthy" if worker.healthy else "unhealthy",
            )
        self._metrics.worker_healthy.labels(worker.worker_id).set(1 if worker.healthy else 0)
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self._registry.all()))

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.interval_s)
            await self.probe_all()
