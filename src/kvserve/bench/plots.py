"""PNG plots of one run or several overlaid (same axes, one legend, one color per run).

A single run is the one-run case of the overlay, so ``kvserve bench`` and
``kvserve bench compare`` draw with the same code.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, safe in any thread or server

import matplotlib.pyplot as plt
import numpy as np
from matplotlib import ticker
from matplotlib.figure import Figure

from kvserve.bench.metrics import requests_per_worker, round_up_125, time_series
from kvserve.bench.report import RunReport

Runs = list[RunReport]

PLOT_FILES = {
    "ttft_cdf": "ttft_cdf.png",
    "over_time": "hit_rate_throughput.png",
    "workers": "requests_per_worker.png",
}


def write_plots(runs: Runs, out_dir: Path) -> dict[str, Path]:
    """Draws every plot into ``out_dir``; returns the files by plot name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / file for name, file in PLOT_FILES.items()}
    plot_ttft_cdf(runs, paths["ttft_cdf"])
    plot_over_time(runs, paths["over_time"])
    plot_requests_per_worker(runs, paths["workers"])
    return paths


def plot_ttft_cdf(runs: Runs, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    all_ms: list[float] = []
    for run in runs:
        ttft_ms = np.sort([r.ttft_s * 1000 for r in run.records if r.ok and r.ttft_s is not None])
        if len(ttft_ms):
            fraction = np.arange(1, len(ttft_ms) + 1) / len(ttft_ms)
            ax.step(ttft_ms, fraction, where="post", label=f"{run.label} (n={len(ttft_ms)})")
            all_ms += [ttft_ms[0], ttft_ms[-1]]
    ax.set_xscale("log")
    # Limits and ticks on 1, 2, 5 × 10^k, as plain numbers: "200", not "2×10²".
    if all_ms:
        ax.set_xlim(_round_down_125(min(all_ms)), round_up_125(max(all_ms)))
    ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _pos: f"{value:g}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize="small")  # a CDF is near 1 there
    _save(fig, path)


def plot_over_time(runs: Runs, path: Path) -> None:
    fig, (hit_ax, tput_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, layout="constrained")
    top_hit = 0.0
    for run in runs:
        series = time_series(run.records, run.summary["duration_s"])
        centers = np.asarray(series.starts_s) + series.bin_s / 2
        hits = np.array([np.nan if h is None else h for h in series.hit_rate], dtype=float)
        (line,) = hit_ax.plot(centers, hits, marker=".", label=run.label)
        top_hit = max(top_hit, float(np.nanmax(hits, initial=0.0)))
        tput_ax.plot(centers, series.output_tokens_per_s, marker=".", color=line.get_color())
    # Zoom in on low hit rates, but never past the meaningful [0, 1].
    hit_ax.set_ylim(0, min(1.02, max(0.1, round_up_125(top_hit * 1.1) if top_hit else 0.1)))
    hit_ax.set_ylabel("prefix hit rate\n(cached / prompt tokens)")
    fig.suptitle("Prefix hit rate and output throughput, by completion time")
    tput_ax.set_ylabel("output throughput (tokens/s)")
    tput_ax.set_ylim(bottom=0)
    tput_ax.set_xlabel("time since start (s)")
    for ax in (hit_ax, tput_ax):
        ax.grid(True, alpha=0.3)
    _legend_below(fig)
    _save(fig, path)


def plot_requests_per_worker(runs: Runs, path: Path) -> None:
    counts = [requests_per_worker([r for r in run.records if r.ok]) for run in runs]
    workers = sorted({w for c in counts for w in c})
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    width = 0.8 / max(len(runs), 1)
    x = np.arange(len(workers))
    for i, (run, per_worker) in enumerate(zip(runs, counts, strict=True)):
        heights = [per_worker.get(w, 0) for w in workers]
        ax.bar(x + (i - (len(runs) - 1) / 2) * width, heights, width, label=run.label)
    ax.set_xticks(x, workers, rotation=20 if len(workers) > 4 else 0)
    ax.set_xlabel("serving worker (x-kvserve-worker)")
    ax.set_ylabel("successful requests")
    ax.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    fig.suptitle("Requests per worker")
    ax.grid(True, axis="y", alpha=0.3)
    _legend_below(fig)
    _save(fig, path)


def _legend_below(fig: Figure) -> None:
    """One legend for the figure, outside the axes where it can hide no data."""
    handles, labels = fig.axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4))


def _round_down_125(value: float) -> float:
    """The largest of 1, 2, 5 × 10^k at or below ``value``."""
    magnitude = 10 ** np.floor(np.log10(value))
    return float(max(m * magnitude for m in (1, 2, 5) if m * magnitude <= value))


def _save(fig: Figure, path: Path) -> None:
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
