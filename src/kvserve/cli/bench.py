"""``kvserve bench``: replay a workload against any OpenAI endpoint, and compare runs.

The bench modules (aiohttp, numpy, matplotlib) are imported when a bench command runs,
so other ``kvserve`` commands start fast.
"""

from __future__ import annotations

import shlex
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, cast

import typer

from kvserve.bench.workloads.spec import describe_sources

_HELP = "\n\n".join(
    [
        "Replay a workload against an OpenAI-compatible endpoint and report TTFT, ITL, "
        "end-to-end latency, throughput, prefix hit rate and requests per worker.",
        "Pacing: the trace's timestamps times --time-scale (open loop, the default for "
        "traces), --rate R (open loop, Poisson arrivals) or --concurrency C (closed loop). "
        "Ctrl-C stops issuing and still writes the report.",
        "Writes DIR/results.json, DIR/report.md and PNG plots.",
        "--workload SPEC is NAME[:PATH][,KEY=VALUE...], e.g. "
        "mooncake-conv:block_tokens=16,max_tokens=32. Data paths default to "
        "$KVSERVE_DATA_DIR, else the shared/data folder beside the kvserve source checkout. "
        "Sources and their keys:",
    ]
)


def _opt(help_text: str) -> typer.models.OptionInfo:
    return cast(typer.models.OptionInfo, typer.Option(help=help_text))


def _redact_api_key(args: list[str]) -> list[str]:
    """The command line as recorded in the report, without the secret."""
    out: list[str] = []
    for arg in args:
        if out and out[-1] == "--api-key":
            arg = "***"
        elif arg.startswith("--api-key="):
            arg = "--api-key=***"
        out.append(arg)
    return out


def _default_dir(prefix: str) -> Path:
    return Path("runs") / f"{prefix}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def register(app: typer.Typer) -> None:
    bench_app = typer.Typer(
        help=_HELP + "\n\n" + "\n\n".join(describe_sources().splitlines()),
        rich_markup_mode=None,
        no_args_is_help=True,
    )
    app.add_typer(bench_app, name="bench")

    @bench_app.callback(invoke_without_command=True)
    def bench(
        ctx: typer.Context,
        endpoint: Annotated[str | None, _opt("Base URL, e.g. http://127.0.0.1:8000")] = None,
        workload: Annotated[str | None, _opt("Workload SPEC (see above).")] = None,
        model: Annotated[str | None, _opt("Model; default: the first of /v1/models.")] = None,
        time_scale: Annotated[float, _opt("Multiply trace timestamps by this.")] = 1.0,
        max_requests: Annotated[int | None, _opt("Replay the first N workload items.")] = None,
        duration: Annotated[float | None, _opt("Stop issuing after S seconds.")] = None,
        concurrency: Annotated[int | None, _opt("Closed loop with C users.")] = None,
        rate: Annotated[float | None, _opt("Open loop, Poisson arrivals per second.")] = None,
        out: Annotated[Path | None, _opt("Output folder; default runs/bench-<time>.")] = None,
        label: Annotated[str | None, _opt("Run name in tables and legends.")] = None,
        request_timeout: Annotated[float, _opt("Seconds before a request fails.")] = 300.0,
        seed: Annotated[int, _opt("Seed for Poisson arrivals.")] = 0,
        api_key: Annotated[
            str | None, typer.Option(help="Bearer token.", envvar="KVSERVE_API_KEY")
        ] = None,
        ignore_eos: Annotated[
            bool, _opt("Ask for exactly the trace's output lengths (ignore_eos).")
        ] = False,
    ) -> None:
        if ctx.invoked_subcommand is not None:
            return
        if endpoint is None or workload is None:
            raise typer.BadParameter("--endpoint and --workload are required")
        from rich.console import Console

        from kvserve.bench.loadgen import LoadConfig
        from kvserve.bench.run import BenchOptions, BenchUsageError, run_bench

        try:
            load = LoadConfig(
                endpoint=endpoint,
                model=model or "",
                concurrency=concurrency,
                rate=rate,
                time_scale=time_scale,
                duration_s=duration,
                request_timeout_s=request_timeout,
                seed=seed,
                api_key=api_key,
                ignore_eos=ignore_eos,
            )
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        options = BenchOptions(
            load=load,
            workload=workload,
            out=out or _default_dir("bench"),
            label=label,
            max_requests=max_requests,
            command=shlex.join(["kvserve", *_redact_api_key(sys.argv[1:])]),
        )
        try:
            _, outcome = run_bench(options, Console(stderr=True))
        except BenchUsageError as exc:
            raise typer.BadParameter(str(exc)) from exc
        typer.echo(f"stopped by {outcome.stopped_by}; wrote {options.out}/ (report.md)")

    @bench_app.command()
    def compare(
        run_dirs: Annotated[list[Path], typer.Argument(help="Folders of earlier bench runs.")],
        out: Annotated[Path | None, _opt("Output folder; default runs/compare-<time>.")] = None,
    ) -> None:
        """Overlay several runs in one table and one set of plots."""
        from rich.console import Console

        from kvserve.bench.compare import compare_runs

        missing = [str(d) for d in run_dirs if not (d / "results.json").is_file()]
        if missing:
            raise typer.BadParameter(f"no results.json in {', '.join(missing)}")
        page = compare_runs(run_dirs, out or _default_dir("compare"), Console())
        typer.echo(f"wrote {page} and plots beside it")
