"""Periodic health checks: a worker that stops answering is skipped until it answers again.

Every worker is checked each ``interval_s`` (60 s by default, as the gateways do); a worker
that has never answered OK, e.g. one still loading its model when the router started, is
checked every second so that it takes traffic as soon as it is up.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvserve.router.config import HealthCheckConfig
from kvserve.router.metrics import RouterMetrics
from kvserve.router.worker_registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)

STARTING_PROBE_INTERVAL_S = 1.0


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

    async def probe_all(self, *, starting_only: bool = False) -> None:
        workers = self._registry.all()
        if starting_only:
            workers = [w for w in workers if not w.ever_healthy]
        await asyncio.gather(*(self.probe(w) for w in workers))

    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        step = min(self._config.interval_s, STARTING_PROBE_INTERVAL_S)
        last_full = loop.time()
        while True:
            await asyncio.sleep(step)
            full = loop.time() - last_full >= self._config.interval_s - step / 2
            if full:
                last_full = loop.time()
            await self.probe_all(starting_only=not full)
