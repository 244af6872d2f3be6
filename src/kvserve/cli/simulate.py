"""``kvserve simulate``: the routing policies on a trace, in virtual time, in seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def simulate(
        trace: Annotated[Path, typer.Option(help="Mooncake-format JSONL trace.", exists=True)],
        workers: Annotated[int, typer.Option(help="Workers in the fleet.")] = 10,
        cache_tokens: Annotated[int, typer.Option(help="KV cache tokens per worker.")] = 3_000_000,
        policy: Annotated[
            str,
            typer.Option(
                help="Comma-separated router policies: cache_aware, kv_aware, round_robin, "
                "random, power_of_two, session, least_loaded; or global (least_loaded over "
                "one shared cache of workers x cache-tokens: the ceiling)."
            ),
        ] = "round_robin,cache_aware,kv_aware,global",
        profile: Annotated[
            str, typer.Option(help="GPU cost profile: llama3-8b-h100 | tiny.")
        ] = "llama3-8b-h100",
        max_num_batched_tokens: Annotated[
            int, typer.Option(help="Token budget of one engine step.")
        ] = 8192,
        limit: Annotated[int | None, typer.Option(help="Replay only the first N requests.")] = None,
        speedup: Annotated[
            float, typer.Option(help="Compress arrival times by this factor (more load).")
        ] = 1.0,
        seed: Annotated[
            int, typer.Option(help="Seed of the random and power_of_two policies.")
        ] = 0,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON, not a table.")] = False,
        out: Annotated[
            Path | None, typer.Option(help="Write results.json, report.md and plots here.")
        ] = None,
    ) -> None:
        """Replay a trace on a simulated fleet once per policy; compare hit rate and TTFT."""
        from rich.console import Console
        from rich.progress import Progress

        from kvserve.core.cost_model import profile as cost_profile
        from kvserve.core.routing.kv_aware import KvAwareConfig
        from kvserve.sim.report import as_json as summaries_json
        from kvserve.sim.report import markdown_table, summarize, write_plots
        from kvserve.sim.simulator import POLICIES, SimConfig
        from kvserve.sim.simulator import simulate as run_simulation
        from kvserve.sim.trace import load_mooncake

        names = [p.strip() for p in policy.split(",") if p.strip()]
        unknown = [p for p in names if p not in POLICIES]
        if unknown or not names:
            raise typer.BadParameter(f"unknown policy {unknown}; choose from {POLICIES}")
        try:
            cost = cost_profile(profile)
            config = SimConfig(
                num_workers=workers,
                cache_tokens=cache_tokens,
                cost=cost,
                max_num_batched_tokens=max_num_batched_tokens,
                seed=seed,
                kv_aware=KvAwareConfig.from_cost_model(cost),
            )
            requests = load_mooncake(trace, limit=limit, speedup=speedup)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from error
        console = Console(stderr=True)
        results = []
        with Progress(console=console, transient=True) as progress:
            for name in names:
                task = progress.add_task(name, total=len(requests))
                results.append(
                    run_simulation(
                        requests, name, config, lambda n, t=task: progress.update(t, completed=n)
                    )
                )
        summaries = [summarize(r) for r in results]
        table = markdown_table(summaries)
        if as_json:
            typer.echo(json.dumps(summaries_json(summaries), indent=2))
        else:
            typer.echo(table)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(summaries_json(summaries), indent=2))
            plots = write_plots(results, out)
            header = (
                f"trace {trace.name}: {len(requests)} requests, {workers} workers x "
                f"{cache_tokens} cache tokens, profile {profile}\n\n"
            )
            images = "".join(f"\n![{p.stem}]({p.name})\n" for p in plots)
            (out / "report.md").write_text(header + table + "\n" + images)
            console.print(f"wrote {out}/results.json, report.md and {len(plots)} plots")
