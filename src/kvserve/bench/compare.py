"""``kvserve bench compare``: several runs in one table and one set of plots."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from kvserve.bench.plots import write_plots
from kvserve.bench.report import load_results, summary_table, write_markdown

COMPARE_FILE = "compare.md"


def compare_runs(run_dirs: list[Path], out_dir: Path, console: Console) -> Path:
    """Loads each run's ``results.json``; labels that repeat get their folder name."""
    reports = [load_results(d) for d in run_dirs]
    labels = [r.label for r in reports]
    runs = [
        (r.label if labels.count(r.label) == 1 else f"{r.label} ({d.name})", r.records)
        for r, d in zip(reports, run_dirs, strict=True)
    ]
    reports = [
        type(r)(label, r.config, r.summary, r.records)
        for r, (label, _) in zip(reports, runs, strict=True)
    ]
    console.print(summary_table(reports))
    plots = write_plots(runs, out_dir)
    return write_markdown(reports, plots, out_dir, COMPARE_FILE)
