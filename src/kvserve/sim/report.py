"""What a simulation run reports per policy: hit rate, TTFT percentiles, throughput,
load imbalance; as a table, as JSON, and as plots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvserve.sim.simulator import SimResult


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


def summarize(result: SimResult) -> PolicySummary:
    served = [r for r in result.records if r.first_token_s is not None]
    ttfts = np.array([r.first_token_s - r.arrival_s for r in served]) if served else np.zeros(1)
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
    )


def as_json(summaries: Sequence[PolicySummary]) -> list[dict[str, object]]:
    return [asdict(s) for s in summaries]


def markdown_table(summaries: Sequence[PolicySummary]) -> str:
    lines = [
        "| policy | hit rate | TTFT p50 (s) | p90 | p99 | mean | output tok/s | imbalance |"
        " sim time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {s.policy} | {s.hit_rate:.3f} | {s.ttft_p50_s:.3f} | {s.ttft_p90_s:.3f} | "
        f"{s.ttft_p99_s:.3f} | {s.ttft_mean_s:.3f} | {s.output_tokens_per_s:.0f} | "
        f"{s.load_imbalance:.2f} | {s.sim_wall_s:.1f} |"
        for s in summaries
    ]
    return "\n".join(lines)


def write_plots(results: Sequence[SimResult], out_dir: Path) -> list[Path]:
    """TTFT CDF per policy (log time axis) and hit rate next to mean TTFT."""
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
    fig.tight_layout()
    fig.savefig(cdf_path, dpi=120)
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
    fig.tight_layout()
    fig.savefig(bars_path, dpi=120)
    plt.close(fig)
    return [cdf_path, bars_path]
