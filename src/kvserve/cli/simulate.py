"""``kvserve simulate``: the routing policies on a trace, in virtual time, in seconds."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from kvserve.sim.simulator import SimConfig


def _show_progress(progress: Progress, task: TaskID, completed: int) -> None:
    progress.update(task, completed=completed)


def _capacity(
    policy: str,
    config: SimConfig,
    trace: Path,
    limit: int | None,
    speedup: float,
    slo_ttft: float,
    console: Console,
) -> dict[str, object]:
    """``--find-max-rate`` for one policy: its highest rate multiple meeting the SLO, and
    every probe simulated on the way."""
    from kvserve.sim.capacity import find_max_rate
    from kvserve.sim.report import summarize
    from kvserve.sim.simulator import simulate
    from kvserve.sim.trace import load_trace

    def p99_at(rate: float) -> float:
        loaded = load_trace(trace, limit=limit, speedup=speedup * rate)
        p99 = summarize(simulate(loaded.requests, policy, config)).ttft_p99_s
        console.print(f"{policy}: x{rate:.3g} p99 TTFT {p99:.3f} s")
        return p99

    result = find_max_rate(p99_at, slo_ttft)
    return {
        "policy": policy,
        "slo_ttft_s": slo_ttft,
        "max_rate": result.max_rate,
        "probes": [{"rate": rate, "ttft_p99_s": p99} for rate, p99 in result.probes],
    }


def register(app: typer.Typer) -> None:
    @app.command()
    def simulate(
        trace: Annotated[
            Path,
            typer.Option(
                help="Mooncake JSONL trace, or Azure CSV trace (arrivals and lengths only: "
                "no prefix sharing).",
                exists=True,
            ),
        ],
        workers: Annotated[int, typer.Option(help="Workers in the fleet.")] = 10,
        prefill: Annotated[
            int | None,
            typer.Option(
                help="With --decode: a prefill/decode fleet of this many prefill workers "
                "(--workers is then their sum); pairs chosen by each policy's pair rule."
            ),
        ] = None,
        decode: Annotated[
            int | None, typer.Option(help="With --prefill: this many decode workers.")
        ] = None,
        transfer_gbps: Annotated[
            float, typer.Option(help="PD fleets: KV transfer bandwidth, GB/s.")
        ] = 12.5,
        transfer_latency: Annotated[
            float, typer.Option(help="PD fleets: seconds each transfer adds.")
        ] = 1e-3,
        cache_tokens: Annotated[int, typer.Option(help="KV cache tokens per worker.")] = 3_000_000,
        store_tokens: Annotated[
            int,
            typer.Option(
                help="Mixed fleets: a KV store of this many tokens every worker writes "
                "through to and loads from (as workers on one --kv-storage); 0: none."
            ),
        ] = 0,
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
        router_replicas: Annotated[
            int,
            typer.Option(
                help="Router replicas taking requests in turn, each with its own guards and "
                "policy, all fed the same KV events."
            ),
        ] = 1,
        load_report_interval: Annotated[
            float | None,
            typer.Option(
                help="With replicas: seconds between workers' load reports, added to each "
                "replica's own guards; 0: before every decision (default: none, each sees "
                "its own guards only)."
            ),
        ] = None,
        announce: Annotated[
            bool,
            typer.Option(
                help="With replicas: each announces its choices and guard changes to the "
                "others, as `kvserve router --peers` does (--no-announce: each sees its "
                "own guards, and the load reports if any)."
            ),
        ] = True,
        announce_delay: Annotated[
            float,
            typer.Option(
                help="With replicas: seconds an announcement takes to reach the others "
                "(default: a loopback HTTP batch's)."
            ),
        ] = 0.0005,
        spread_arrivals: Annotated[
            bool,
            typer.Option(
                help="Spread each group of same-instant arrivals over the gap to the next "
                "(the Mooncake traces stamp arrivals in 3-second buckets); seeded by --seed."
            ),
        ] = False,
        seed: Annotated[
            int, typer.Option(help="Seed of the random and power_of_two policies.")
        ] = 0,
        kv_aware_replica_spread: Annotated[
            float | None,
            typer.Option(
                help="kv_aware with router replicas: each offsets its scores by up to this "
                "many seconds per worker, fixed per (replica, worker), so that near-equal "
                "choices differ across replicas (default: the policy's own; 0: none)."
            ),
        ] = None,
        kv_aware_replica_burst_window: Annotated[
            float | None,
            typer.Option(
                help="kv_aware with router replicas: the salt and the stagger apply only "
                "while at least half of the last gaps between the requests a replica "
                "knows of (its own, its peers' announced) are under this many seconds "
                "(default: the policy's own; 0: every decision)."
            ),
        ] = None,
        kv_aware_replica_stagger: Annotated[
            float | None,
            typer.Option(
                help="kv_aware with router replicas: in a burst, replica r (0, 1, ...) "
                "chooses r times this many seconds after a request arrives, having heard "
                "the lower ranks' choices (default: the policy's own; 0: all at once)."
            ),
        ] = None,
        kv_aware_recompute_weight: Annotated[
            float | None,
            typer.Option(
                help="kv_aware: score seconds per second of prefill a choice computes "
                "beyond the deepest holder's (default: the policy's own)."
            ),
        ] = None,
        kv_aware_home_weight: Annotated[
            float | None,
            typer.Option(
                help="kv_aware: score seconds per second of a worker's wait, times the share "
                "of the prompt computed there (a prefix's new home; it also scales the "
                "recompute weight by the holder's share; default: the policy's own)."
            ),
        ] = None,
        kv_aware_home_slack_queue: Annotated[
            float | None,
            typer.Option(
                help="kv_aware: the home weight applies only while the mean worker's guarded "
                "prefill is at most this many seconds (default: the policy's own; inf: "
                "always)."
            ),
        ] = None,
        kv_aware_recompute_slack_queue: Annotated[
            float | None,
            typer.Option(
                help="kv_aware: the recompute weight applies only while the mean worker's "
                "guarded prefill is at most this many seconds; past both bounds, TTFT "
                "alone ranks (default: the policy's own; inf: always)."
            ),
        ] = None,
        kv_aware_retention_margin: Annotated[
            float | None,
            typer.Option(
                help="kv_aware: the recompute weight is discounted to 0 as the holder's "
                "predicted wait nears 1/margin of its cache's retention time (0: no "
                "discount; default: the policy's own)."
            ),
        ] = None,
        kv_aware_retention_window: Annotated[
            float | None,
            typer.Option(
                help="kv_aware: seconds over which a worker's eviction rate is averaged "
                "(default: the policy's own)."
            ),
        ] = None,
        slo_ttft: Annotated[
            float | None,
            typer.Option(
                help="TTFT target in seconds: report each policy's goodput, the share of "
                "requests whose first token came within it (rejected ones miss)."
            ),
        ] = None,
        find_max_rate: Annotated[
            bool,
            typer.Option(
                "--find-max-rate",
                help="With --slo-ttft: per policy, search the highest multiple of the "
                "arrival rate (of --speedup's) whose p99 TTFT meets the SLO; one whole "
                "simulation per probe.",
            ),
        ] = False,
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
        from kvserve.sim.arrival_spread import spread_arrivals as spread
        from kvserve.sim.report import (
            COLUMN_NOTES,
            markdown_table,
            rich_table,
            summarize,
            write_plots,
        )
        from kvserve.sim.report import as_json as summaries_json
        from kvserve.sim.simulator import POLICIES, SimConfig
        from kvserve.sim.simulator import simulate as run_simulation
        from kvserve.sim.trace import load_trace

        names = [p.strip() for p in policy.split(",") if p.strip()]
        unknown = [p for p in names if p not in POLICIES]
        if unknown or not names:
            raise typer.BadParameter(f"unknown policy {unknown}; choose from {POLICIES}")
        if slo_ttft is not None and slo_ttft <= 0:
            raise typer.BadParameter("--slo-ttft must be > 0")
        if find_max_rate and slo_ttft is None:
            raise typer.BadParameter("--find-max-rate needs --slo-ttft")
        if (prefill is None) != (decode is None):
            raise typer.BadParameter("--prefill and --decode go together")
        if prefill is not None and decode is not None:
            if prefill < 1 or decode < 1:
                raise typer.BadParameter("--prefill and --decode must be >= 1")
            workers = prefill + decode
        # kv_aware's flags given (None: the policy's own default)
        kv_aware_flags = {
            "recompute_weight": kv_aware_recompute_weight,
            "home_weight": kv_aware_home_weight,
            "home_slack_queue_s": kv_aware_home_slack_queue,
            "recompute_slack_queue_s": kv_aware_recompute_slack_queue,
            "retention_margin": kv_aware_retention_margin,
            "retention_window_s": kv_aware_retention_window,
            "replica_spread_s": kv_aware_replica_spread,
            "replica_burst_window_s": kv_aware_replica_burst_window,
            "replica_stagger_s": kv_aware_replica_stagger,
        }
        kv_aware_overrides = {k: v for k, v in kv_aware_flags.items() if v is not None}
        try:
            cost = cost_profile(profile)
            kv_aware = KvAwareConfig.from_cost_model(cost, **kv_aware_overrides)
            config = SimConfig(
                num_workers=workers,
                cache_tokens=cache_tokens,
                cost=cost,
                max_num_batched_tokens=max_num_batched_tokens,
                seed=seed,
                kv_aware=kv_aware,
                router_replicas=router_replicas,
                load_report_interval_s=load_report_interval,
                announce_delay_s=announce_delay if announce and router_replicas > 1 else None,
                prefill_workers=prefill or 0,
                transfer_gbps=transfer_gbps,
                transfer_latency_s=transfer_latency,
                store_tokens=store_tokens,
                store_load_token_s=kv_aware.storage_load_token_s,
            )
            loaded = load_trace(trace, limit=limit, speedup=speedup)
            if spread_arrivals:
                loaded = dataclasses.replace(
                    loaded, requests=spread(loaded.requests, seed), name=loaded.name + " (spread)"
                )
        except ValueError as error:
            raise typer.BadParameter(str(error)) from error
        setup = (
            f"trace {loaded.name} ({len(loaded.requests)} requests, arrivals x{speedup:g}), "
            + (
                f"{prefill} prefill + {decode} decode workers (KV transfers at "
                f"{transfer_gbps:g} GB/s + {transfer_latency:g} s)"
                if prefill
                else f"{workers} workers"
            )
            + f" x {cache_tokens:,} cache tokens, profile {profile}, "
            + (f"a {store_tokens:,}-token shared store, " if store_tokens else "")
            + f"{router_replicas} router replica(s)"
            + (f", load reports every {load_report_interval:g} s" if load_report_interval else "")
            + (
                f", announcements after {announce_delay:g} s"
                if config.announce_delay_s is not None
                else ""
            )
        )
        console = Console(stderr=True)
        if find_max_rate and slo_ttft is not None:
            found = [
                _capacity(name, config, trace, limit, speedup, slo_ttft, console) for name in names
            ]
            if as_json:
                typer.echo(json.dumps(found, indent=2))
            else:
                typer.echo(setup)
                for row in found:
                    rate = row["max_rate"]
                    answer = (
                        "never (not even the lowest rate searched)"
                        if rate is None
                        else (f"x{rate:.3g} of these arrivals")
                    )
                    typer.echo(f"{row['policy']}: p99 TTFT <= {slo_ttft:g} s up to {answer}")
            return
        results = []
        with Progress(console=console, transient=True) as progress:
            for name in names:
                task = progress.add_task(name, total=len(loaded.requests))
                results.append(
                    run_simulation(
                        loaded.requests,
                        name,
                        config,
                        functools.partial(_show_progress, progress, task),
                    )
                )
        summaries = [summarize(r, slo_ttft) for r in results]
        notes = list(COLUMN_NOTES)
        if not loaded.shares_prefixes:
            notes.insert(0, f"{loaded.name} has no prefix sharing: every hit rate is 0 by design")
        if as_json:
            typer.echo(json.dumps(summaries_json(summaries), indent=2))
        else:
            typer.echo(setup)
            Console().print(rich_table(summaries, "kvserve simulate"))
            for note in notes:
                typer.echo(f"  {note}")
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(summaries_json(summaries), indent=2))
            plots = write_plots(results, out, setup)
            explained = "".join(f"- {note}\n" for note in notes)
            images = "".join(f"\n![{p.stem}]({p.name})\n" for p in plots)
            page = f"# kvserve simulate\n\n{setup}\n\n{markdown_table(summaries)}\n\n{explained}"
            (out / "report.md").write_text(page + images)
            console.print(f"wrote {out}/results.json, report.md and {len(plots)} plots")
