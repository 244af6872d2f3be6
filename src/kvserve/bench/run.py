"""One bench run end to end: build the workload, replay it with a live progress bar,
then write results.json, the plots and report.md and print the table."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from kvserve.bench.client import auth_headers, first_model
from kvserve.bench.loadgen import LoadConfig, LoadGenerator, RunOutcome
from kvserve.bench.plots import write_plots
from kvserve.bench.progress import LiveProgress
from kvserve.bench.report import (
    REPORT_FILE,
    RunReport,
    error_lines,
    make_report,
    save_results,
    summary_table,
    write_markdown,
)
from kvserve.bench.workloads import Workload, WorkloadSpecError, build_workload


class BenchUsageError(ValueError):
    """The run cannot start as asked: bad workload, pacing or endpoint."""


@dataclass(frozen=True)
class BenchOptions:
    load: LoadConfig  # an empty model means: ask the endpoint
    workload: str  # SPEC
    out: Path
    label: str | None = None
    max_requests: int | None = None
    command: str = ""  # the command line, recorded in the report


def run_bench(options: BenchOptions, console: Console) -> tuple[RunReport, RunOutcome]:
    try:
        workload = build_workload(options.workload, limit=options.max_requests)
    except WorkloadSpecError as exc:
        raise BenchUsageError(str(exc)) from exc
    config = options.load
    if not workload.timed and config.concurrency is None and config.rate is None:
        raise BenchUsageError(f"{workload.name} has no timestamps: give --rate or --concurrency")
    config, outcome = asyncio.run(_replay(config, workload, console))
    report = make_report(
        options.label or workload.name,
        _describe(options, config, outcome),
        outcome.records,
        outcome.duration_s,
    )
    save_results(report, options.out)
    plots = write_plots([report], options.out)
    write_markdown([report], plots, options.out, REPORT_FILE)
    console.print(summary_table([report]))
    for line in error_lines(report):
        console.print(line, style="red", markup=False, highlight=False, soft_wrap=True)
    return report, outcome


async def _replay(
    config: LoadConfig, workload: Workload, console: Console
) -> tuple[LoadConfig, RunOutcome]:
    """Runs the load; returns the config with the model filled in, and the outcome."""
    if not config.model:
        try:
            timeout = aiohttp.ClientTimeout(total=30)
            headers = auth_headers(config.api_key)
            async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
                model = await first_model(session, config.endpoint)
        except (aiohttp.ClientError, TimeoutError, KeyError, RuntimeError) as exc:
            raise BenchUsageError(f"cannot list models at {config.endpoint}: {exc}") from exc
        config = dataclasses.replace(config, model=model)
    loop = asyncio.get_running_loop()
    with LiveProgress(workload.size, console) as progress:
        generator = LoadGenerator(config, progress)
        loop.add_signal_handler(signal.SIGINT, generator.stop)
        try:
            outcome = await generator.run(workload.requests)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
    return config, outcome


def _describe(options: BenchOptions, config: LoadConfig, outcome: RunOutcome) -> dict[str, Any]:
    started = datetime.fromtimestamp(outcome.started_at, UTC)
    policies = {r.policy for r in outcome.records if r.policy}
    return {
        "command": options.command,
        "endpoint": config.endpoint,
        "model": config.model,
        "workload": options.workload,
        "pacing": _pacing(config),
        "ignore_eos": config.ignore_eos,
        "max_requests": options.max_requests,
        "duration_limit_s": config.duration_s,
        "router_policy": ", ".join(sorted(policies)) or "not named (not a kvserve router)",
        "workers": ", ".join(sorted({r.worker for r in outcome.records if r.worker})) or "-",
        "stopped_by": outcome.stopped_by,
        "abandoned_in_flight": outcome.abandoned,
        "started_at": started.isoformat(timespec="seconds"),
    }


def _pacing(config: LoadConfig) -> str:
    if config.concurrency is not None:
        return f"closed loop, concurrency {config.concurrency}"
    if config.rate is not None:
        return f"open loop, Poisson {config.rate}/s"
    return f"open loop, trace timestamps x {config.time_scale}"
