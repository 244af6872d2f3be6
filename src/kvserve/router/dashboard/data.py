"""The body of ``/dashboard/data``: everything the page shows, in one JSON object built
from what the router holds (load guards, its registry of metrics, the decision ring) and
what the sampler last read from the workers. Its shape is documented in
``docs/internals.md`` (Router: dashboard)."""

from __future__ import annotations

import time

from kvserve.router.dashboard.router_figures import NO_WORKER, RouterFigures, read_router_figures
from kvserve.router.dashboard.sampler import FleetSampler
from kvserve.router.dashboard.worker_report import WorkerReport
from kvserve.router.load_guard import LoadTracker
from kvserve.router.metrics import RouterMetrics
from kvserve.router.worker_registry import Worker, WorkerRegistry


def dashboard_data(
    registry: WorkerRegistry,
    tracker: LoadTracker,
    metrics: RouterMetrics,
    sampler: FleetSampler,
    policy: str,
) -> dict[str, object]:
    figures = sampler.summed_figures or read_router_figures(metrics.registry.collect())
    workers = registry.all()
    reports = [r for w in workers if (r := sampler.reports.get(w.worker_id)) is not None]
    rows = []
    for worker in workers:
        load = tracker.load(worker.worker_id)
        counts = figures.workers[worker.worker_id]
        report = sampler.reports.get(worker.worker_id)
        rows.append(
            {
                **worker.describe(),
                "in_flight_requests": load.in_flight_requests,
                "in_flight_prefill_tokens": load.in_flight_prefill_tokens,
                "requests": counts.requests,
                "requests_by_status": counts.requests_by_status,
                "errors": counts.errors,
                "errors_by_kind": counts.errors_by_kind,
                "retries": counts.retries,
                "ttft_mean_s": counts.ttft_sum_s / counts.ttft_count if counts.ttft_count else None,
                "kv": None if report is None else report.describe(),
            }
        )
    return {
        "time": time.time(),
        "policy": policy,
        "sample_interval_s": sampler.interval_s,
        "fleet": _fleet(workers, figures, tracker, reports),
        "workers": rows,
        "decisions": {
            "by_reason": [
                {"policy": p, "reason": r, "count": count}
                for (p, r), count in sorted(figures.decisions.items())
            ],
            "recent": metrics.recent_decisions.recent(),
        },
        "history": sampler.history.series([w.worker_id for w in workers]),
    }


def _fleet(
    workers: list[Worker], figures: RouterFigures, tracker: LoadTracker, reports: list[WorkerReport]
) -> dict[str, object]:
    """Totals over the workers. Errors include rejections no worker saw (bad requests, no
    healthy worker); KV totals cover the workers whose ``/metrics`` answered."""
    loads = [tracker.load(w.worker_id) for w in workers]
    counts = [figures.workers[w.worker_id] for w in workers]
    queried = sum(r.prefix_queried_tokens for r in reports)
    hits = sum(r.prefix_hit_tokens for r in reports)
    return {
        "workers": len(workers),
        "healthy_workers": sum(1 for w in workers if w.healthy),
        "in_flight_requests": sum(load.in_flight_requests for load in loads),
        "in_flight_prefill_tokens": sum(load.in_flight_prefill_tokens for load in loads),
        "requests": sum(c.requests for c in counts),
        "errors": sum(c.errors for c in counts) + figures.workers[NO_WORKER].errors,
        "workers_reporting_kv": len(reports),
        "kv": {
            "running": sum(r.running for r in reports),
            "waiting": sum(r.waiting for r in reports),
            "blocks": {
                "used": sum(r.blocks_used for r in reports),
                "cached": sum(r.blocks_cached for r in reports),
                "free": sum(r.blocks_free for r in reports),
                "total": sum(r.blocks_total for r in reports),
            },
            "prefix_cache": {
                "queried_tokens": queried,
                "hit_tokens": hits,
                "hit_rate": hits / queried if queried else None,
            },
        },
    }
