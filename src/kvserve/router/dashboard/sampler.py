"""The dashboard's one background task: every interval, scrape every worker's ``/metrics``
(concurrently, each bounded by the interval) and add a sample of the router's counters to
the history. The request path never waits for it, and the dashboard's data requests read
only what it last stored, so N viewers cost the workers nothing more than one.

A worker whose ``/metrics`` is another server's (vLLM, SGLang) is asked again only every
``FOREIGN_RETRY_S``: its exposition has nothing the dashboard reads, and rendering it costs
the worker's API process milliseconds that its requests wait for (measured on a vLLM CPU
server: 4–35 ms a scrape). It is asked at all so that a URL later served by a kvserve
worker is seen within a minute."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
from prometheus_client.core import Metric

from kvserve.router.dashboard.history import History, Totals
from kvserve.router.dashboard.router_figures import RouterFigures, read_router_figures
from kvserve.router.dashboard.worker_report import NoReport, WorkerReport, scrape_worker
from kvserve.router.metrics import RouterMetrics
from kvserve.router.worker_registry import WorkerRegistry

SAMPLE_INTERVAL_S = 1.0
SummedFamilies = Callable[[], Awaitable[tuple[list[Metric], int]]]
FOREIGN_RETRY_S = 60.0


class FleetSampler:
    def __init__(
        self,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        interval_s: float = SAMPLE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        summed_families: SummedFamilies | None = None,
    ) -> None:
        self._registry = registry
        self._metrics = metrics
        # With several router processes: every process's counters, summed; the latest
        # figures read from them are what the dashboard shows (the router's, not this
        # process's share).
        self._summed_families = summed_families
        self.summed_figures: RouterFigures | None = None
        self._session = session
        self.interval_s = interval_s
        self._clock = clock
        self._wall_clock = wall_clock
        self.history = History()
        self.reports: dict[str, WorkerReport] = {}  # the latest answer of each worker
        self._foreign_at: dict[str, float] = {}  # worker id -> when it last answered foreign

    async def sample(self) -> None:
        workers = self._registry.all()
        now, scraped_at = self._clock(), self._wall_clock()
        asked = [w for w in workers if self._due(w.worker_id, now)]
        answers = await asyncio.gather(
            *(scrape_worker(self._session, w.url, self.interval_s, scraped_at) for w in asked)
        )
        self.reports = {}
        self._foreign_at = {
            w.worker_id: self._foreign_at[w.worker_id]
            for w in workers
            if w.worker_id in self._foreign_at
        }
        for worker, answer in zip(asked, answers, strict=True):
            if isinstance(answer, WorkerReport):
                self.reports[worker.worker_id] = answer
                self._foreign_at.pop(worker.worker_id, None)
            elif answer is NoReport.FOREIGN:
                self._foreign_at[worker.worker_id] = now
        if self._summed_families is None:
            figures = read_router_figures(self._metrics.registry.collect())
        else:
            figures = self.summed_figures = read_router_figures((await self._summed_families())[0])
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
        self.history.add(now, totals)

    def _due(self, worker_id: str, now: float) -> bool:
        found_foreign = self._foreign_at.get(worker_id)
        return found_foreign is None or now - found_foreign >= FOREIGN_RETRY_S

    async def run_forever(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval_s)
