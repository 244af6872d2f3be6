"""The dashboard's one background task: every interval, scrape every worker's ``/metrics``
(concurrently, each bounded by the interval) and add a sample of the router's counters to
the history. The request path never waits for it, and the dashboard's data requests read
only what it last stored, so N viewers cost the workers nothing more than one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from kvserve.router.dashboard.history import History, Totals
from kvserve.router.dashboard.router_figures import read_router_figures
from kvserve.router.dashboard.worker_report import WorkerReport, scrape_worker
from kvserve.router.metrics import RouterMetrics
from kvserve.router.worker_registry import WorkerRegistry

SAMPLE_INTERVAL_S = 1.0


class FleetSampler:
    def __init__(
        self,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        interval_s: float = SAMPLE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._metrics = metrics
        self._session = session
        self.interval_s = interval_s
        self._clock = clock
        self._wall_clock = wall_clock
        self.history = History()
        self.reports: dict[str, WorkerReport] = {}  # the latest answer of each worker

    async def sample(self) -> None:
        workers = self._registry.all()
        scraped_at = self._wall_clock()
        answers = await asyncio.gather(
            *(scrape_worker(self._session, w.url, self.interval_s, scraped_at) for w in workers)
        )
        self.reports = {w.worker_id: a for w, a in zip(workers, answers, strict=True) if a}
        figures = read_router_figures(self._metrics.registry)
        totals = {}
        for worker in workers:
            counts = figures.workers[worker.worker_id]
            report = self.reports.get(worker.worker_id)
            totals[worker.worker_id] = Totals(
                requests=counts.requests,
                ttft_sum_s=counts.ttft_sum_s,
                ttft_count=counts.ttft_count,
                ttft_buckets=tuple(sorted(counts.ttft_buckets.items())),
                generation_tokens=None if report is None else report.generation_tokens,
            )
        self.history.add(self._clock(), totals)

    async def run_forever(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval_s)
