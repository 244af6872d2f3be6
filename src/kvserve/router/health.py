"""Periodic health checks: a worker that stops answering is skipped until it answers again.

Every worker is checked each ``interval_s`` (60 s by default, as the gateways do); a
*suspect* worker (never OK yet, e.g. still loading its model; unhealthy; its last check
failed; its breaker not closed) is checked every second, so that a dead or hung worker is
taken out, and a returning one readmitted, within seconds. A kvserve worker's ``/health``
names its process (``instance``): a new name means the worker restarted, which is
counted (``kvserve_router_worker_restarts``) and readmits it at once. A worker taken
out has the attempts still waiting for its answer retried elsewhere (``taken_out.py``).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson

from kvserve.router.config import HealthCheckConfig
from kvserve.router.metrics import RouterMetrics
from kvserve.router.taken_out import take_out
from kvserve.router.worker_registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)

STARTING_PROBE_INTERVAL_S = 1.0


def _instance(body: bytes) -> str | None:
    """The ``instance`` a ``/health`` body names, if it is JSON that names one (a server
    other than kvserve's worker may answer anything)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    instance = payload.get("instance") if isinstance(payload, dict) else None
    return instance if isinstance(instance, str) else None


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
                instance = _instance(await response.read()) if ok else None
        except (aiohttp.ClientError, TimeoutError):
            ok, instance = False, None
        if instance is not None and worker.record_instance(instance):
            log.warning("worker %s (%s) restarted", worker.worker_id, worker.url)
            self._metrics.worker_restarts.labels(worker.worker_id).inc()
        if worker.record_health(ok, self._config):
            log.warning(
                "worker %s (%s) is now %s",
                worker.worker_id,
                worker.url,
                "healthy" if worker.healthy else "unhealthy",
            )
            if not worker.healthy and (cancelled := take_out(worker)):
                log.warning("retrying %d requests waiting on %s elsewhere", cancelled, worker.url)
        self._metrics.worker_healthy.labels(worker.worker_id).set(1 if worker.healthy else 0)
        return ok

    async def probe_all(self, *, suspect_only: bool = False) -> None:
        workers = self._registry.all()
        if suspect_only:
            workers = [w for w in workers if w.suspect]
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
            await self.probe_all(suspect_only=not full)
