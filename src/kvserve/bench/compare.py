"""``kvserve bench compare``: several runs in one table and one set of plots."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console

from kvserve.bench.plots import write_plots
from kvserve.bench.report import load_results, summary_table, write_markdown

COMPARE_FILE = "compare.md"


def compare_runs(run_dirs: list[Path], out_dir: Path, console: Console) -> Path:
    """Loads each run's ``results.json``; labels that repeat get their folder name."""
    reports = [load_results(d) for d in run_dirs]
    labels = [r.label for r in reports]
    reports = [
        r if labels.count(r.label) == 1 else dataclasses.replace(r, label=f"{r.label} ({d.name})")
        for r, d in zip(reports, run_dirs, strict=True)
    ]
    console.print(summary_table(reports))
    plots = write_plots(reports, out_dir)
    return write_markdown(reports, plots, out_dir, COMPARE_FILE)
