"""What a simulation run reports per policy: hit rate, TTFT percentiles, throughput,
load imbalance; as a table, as JSON, and as plots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich import box
from rich.table import Table

from kvserve.sim.simulator import RequestRecord, SimResult

# What each column means, printed under the table: a reader should not have to guess.
COLUMN_NOTES = (
    "hit rate: prompt tokens served from a KV cache / prompt tokens, over served requests",
    "TTFT: arrival to first token, in seconds of simulated time (p50, p99, mean)",
    "tok/s: generated tokens / (last finish - first arrival)",
    "imbalance: the busiest worker's computed tokens / the mean over workers "
    "(1.00 = perfectly even; recomputation after preemption counts)",
    "rejected: prompts longer than a worker's whole cache (never served)",
    "PD fleets: remote = share of requests prefilled by a prefill worker, transfer = "
    "their mean KV transfer time (s); imbalance spans both pools",
    "report.md and --json add TTFT p90, preemptions and the simulation's own run time",
)


@dataclass(frozen=True, slots=True)
class PolicySummary:
    policy: str
    requests: int
    rejected: int  # longer than a worker's whole cache
    hit_rate: float  # prompt tokens served from cache / prompt tokens
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    output_tokens_per_s: float  # over the whole run: first arrival to last finish
    load_imbalance: float  # max / mean tokens computed per worker (1.0 = even)
    preemptions: int
    sim_wall_s: float
    # Share of all requests (rejected ones miss) whose TTFT met ``slo_ttft_s``; None
    # without an SLO.
    slo_ttft_s: float | None = None
    goodput: float | None = None
    # PD fleets (None otherwise): the share of served requests whose KV a prefill worker
    # computed and the decode worker installed, and those transfers' mean time
    pd_remote_share: float | None = None
    pd_transfer_mean_s: float | None = None
    unfinished: int = 0  # never served: stuck when nothing was left to happen
    # With a shared store (None otherwise): prompt tokens loaded from it / prompt tokens,
    # over served requests (a part of the hit rate)
    store_hit_rate: float | None = None


def summarize(result: SimResult, slo_ttft_s: float | None = None) -> PolicySummary:
    """The figures of one run; with ``slo_ttft_s``, the share of requests meeting it."""
    served = [r for r in result.records if r.first_token_s is not None]
    waits = [r.first_token_s - r.arrival_s for r in result.records if r.first_token_s is not None]
    ttfts = np.array(waits) if waits else np.zeros(1)
    prompt = sum(r.prompt_tokens for r in served)
    start = min((r.arrival_s for r in result.records), default=0.0)
    end = max((r.finish_s for r in served if r.finish_s is not None), default=start)
    work = list(result.computed_tokens.values())
    mean_work = sum(work) / len(work) if work else 0.0
    return PolicySummary(
        policy=result.policy,
        requests=len(result.records),
        rejected=len(result.records) - len(served),
        hit_rate=sum(r.cached_tokens for r in served) / prompt if prompt else 0.0,
        ttft_p50_s=float(np.percentile(ttfts, 50)),
        ttft_p90_s=float(np.percentile(ttfts, 90)),
        ttft_p99_s=float(np.percentile(ttfts, 99)),
        ttft_mean_s=float(ttfts.mean()),
        output_tokens_per_s=sum(r.output_tokens for r in served) / max(end - start, 1e-9),
        load_imbalance=max(work) / mean_work if mean_work else 1.0,
        preemptions=result.preemptions,
        sim_wall_s=result.wall_s,
        slo_ttft_s=slo_ttft_s,
        goodput=None if slo_ttft_s is None else _goodput(waits, len(result.records), slo_ttft_s),
        pd_remote_share=_remote_share(result, served),
        pd_transfer_mean_s=_transfer_mean(result, served),
        unfinished=result.unfinished,
        store_hit_rate=_store_hit_rate(result, prompt),
    )


def _store_hit_rate(result: SimResult, prompt_tokens: int) -> float | None:
    if result.store_loaded_tokens is None:
        return None
    return result.store_loaded_tokens / prompt_tokens if prompt_tokens else 0.0


def _remote_share(result: SimResult, served: Sequence[RequestRecord]) -> float | None:
    if not result.prefill_workers:
        return None
    remote = sum(1 for r in served if r.prefill_worker_id is not None)
    return remote / len(served) if served else 0.0


def _transfer_mean(result: SimResult, served: Sequence[RequestRecord]) -> float | None:
    times = [r.transfer_s for r in served if r.transfer_s is not None]
    if not result.prefill_workers:
        return None
    return sum(times) / len(times) if times else 0.0


def _goodput(waits: Sequence[float], requests: int, slo_ttft_s: float) -> float:
    return sum(1 for w in waits if w <= slo_ttft_s) / requests if requests else 0.0


def as_json(summaries: Sequence[PolicySummary]) -> list[dict[str, object]]:
    return [asdict(s) for s in summaries]


def _cells(s: PolicySummary) -> list[str]:
    return [
        s.policy,
        f"{s.hit_rate:.3f}",
        f"{s.ttft_p50_s:.3f}",
        f"{s.ttft_p90_s:.3f}",
        f"{s.ttft_p99_s:.3f}",
        f"{s.ttft_mean_s:.3f}",
        f"{s.output_tokens_per_s:.0f}",
        f"{s.load_imbalance:.2f}",
        str(s.preemptions),
        str(s.rejected),
        f"{s.sim_wall_s:.1f}",
    ]


_COLUMNS = (
    "policy",
    "hit rate",
    "TTFT p50 (s)",
    "p90",
    "p99",
    "mean",
    "output tok/s",
    "imbalance",
    "preemptions",
    "rejected",
    "sim time (s)",
)


# The terminal shows the columns that decide between policies, narrow enough for 80
# characters; report.md and --json carry all of them.
_TERMINAL_COLUMNS = {  # header -> column
    "policy": "policy",
    "hit rate": "hit rate",
    "TTFT p50": "TTFT p50 (s)",
    "p99": "p99",
    "mean": "mean",
    "tok/s": "output tok/s",
    "imbalance": "imbalance",
    "rejected": "rejected",
}


def _with_goodput(
    summaries: Sequence[PolicySummary], headers: Sequence[str], rows: list[list[str]]
) -> tuple[list[str], list[list[str]]]:
    """PD columns when the fleet was disaggregated, an unfinished count when a request
    never finished, and a goodput column when the run had an SLO."""
    if summaries and summaries[0].pd_remote_share is not None:
        headers = [*headers, "remote", "transfer (s)"]
        rows = [
            [*row, f"{s.pd_remote_share or 0:.2f}", f"{s.pd_transfer_mean_s or 0:.4f}"]
            for row, s in zip(rows, summaries, strict=True)
        ]
    if any(s.unfinished for s in summaries):
        headers = [*headers, "unfinished"]
        rows = [[*row, str(s.unfinished)] for row, s in zip(rows, summaries, strict=True)]
    slo = summaries[0].slo_ttft_s if summaries else None
    if slo is None:
        return list(headers), rows
    cells = [f"{s.goodput:.3f}" if s.goodput is not None else "" for s in summaries]
    return [*headers, f"goodput (TTFT <= {slo:g} s)"], [
        [*row, cell] for row, cell in zip(rows, cells, strict=True)
    ]


def rich_table(summaries: Sequence[PolicySummary], title: str) -> Table:
    """The terminal table: one row per policy, numbers right-aligned."""
    table = Table(
        title=title, box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False, show_edge=False
    )
    rows = []
    for summary in summaries:
        cells = dict(zip(_COLUMNS, _cells(summary), strict=True))
        rows.append([cells[column] for column in _TERMINAL_COLUMNS.values()])
    headers, rows = _with_goodput(summaries, list(_TERMINAL_COLUMNS), rows)
    for index, header in enumerate(headers):
        table.add_column(
            header,
            justify="left" if index == 0 else "right",
            no_wrap=True,
            min_width=max(len(header), 5),
        )
    for row in rows:
        table.add_row(*row)
    return table


def markdown_table(summaries: Sequence[PolicySummary]) -> str:
    headers, rows = _with_goodput(summaries, _COLUMNS, [_cells(s) for s in summaries])
    lines = ["| " + " | ".join(headers) + " |", "|---|" + "---:|" * (len(headers) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_plots(results: Sequence[SimResult], out_dir: Path, setup: str) -> list[Path]:
    """TTFT CDF per policy (log time axis) and hit rate next to mean TTFT, each titled
    with ``setup`` (trace, fleet, cache size) so a plot read alone still says what it is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    cdf_path, bars_path = out_dir / "sim_ttft_cdf.png", out_dir / "sim_hit_rate_ttft.png"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result in results:
        ttfts = np.sort([r.first_token_s - r.arrival_s for r in result.records if r.first_token_s])
        ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / max(len(ttfts), 1), label=result.policy)
    ax.set(xscale="log", xlabel="time to first token (s)", ylabel="fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"TTFT by policy\n{setup}", fontsize=10)
    fig.tight_layout()
    fig.savefig(cdf_path, dpi=120, metadata={"Title": f"TTFT by policy: {setup}"})
    plt.close(fig)

    summaries = [summarize(r) for r in results]
    names = [s.policy for s in summaries]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    left.bar(names, [s.hit_rate for s in summaries], color="tab:blue")
    left.set(ylabel="prefix hit rate (tokens)", ylim=(0, 1))
    right.bar(names, [s.ttft_mean_s for s in summaries], color="tab:orange", label="mean")
    right.plot(names, [s.ttft_p90_s for s in summaries], "k_", markersize=20, label="p90")
    right.set(ylabel="TTFT (s)")
    right.legend()
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.suptitle(f"hit rate and TTFT by policy\n{setup}", fontsize=10)
    fig.tight_layout()
    fig.savefig(bars_path, dpi=120, metadata={"Title": f"hit rate and TTFT: {setup}"})
    plt.close(fig)
    return [cdf_path, bars_path]
