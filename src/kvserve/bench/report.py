"""Run results on disk (``results.json``), the summary table (terminal and Markdown) and
``report.md``.

The table puts metrics in rows and runs in columns, so one run and a comparison of
several are the same table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.table import Table

from kvserve.bench.metrics import RequestRecord, summarize

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"


@dataclass(frozen=True)
class RunReport:
    label: str
    config: dict[str, Any]  # how the run was made: endpoint, workload, pacing, stop reason
    summary: dict[str, Any]
    records: list[RequestRecord]


def make_report(
    label: str, config: dict[str, Any], records: list[RequestRecord], duration_s: float
) -> RunReport:
    return RunReport(label, config, summarize(records, duration_s), records)


def save_results(report: RunReport, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_FILE
    payload = {
        "label": report.label,
        "config": report.config,
        "summary": report.summary,
        "requests": [r.to_dict() for r in report.records],
    }
    path.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
    return path


def load_results(run_dir: Path) -> RunReport:
    raw = orjson.loads((run_dir / RESULTS_FILE).read_bytes())
    records = [RequestRecord.from_dict(r) for r in raw["requests"]]
    return RunReport(raw["label"], raw["config"], raw["summary"], records)


def _ms(key: str, stat: str) -> Callable[[dict[str, Any]], str]:
    return lambda s: "-" if s[key][stat] is None else f"{s[key][stat]:.1f}"


def _hit_rate(s: dict[str, Any]) -> str:
    return "-" if s["prefix_hit_rate"] is None else f"{s['prefix_hit_rate']:.3f}"


def _workers(s: dict[str, Any]) -> str:
    return ", ".join(f"{w}:{n}" for w, n in s["requests_per_worker"].items()) or "-"


ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("requests (ok / errors)", lambda s: f"{s['ok']} / {s['errors']}"),
    ("error rate", lambda s: f"{s['error_rate']:.1%}"),
    ("duration (s)", lambda s: f"{s['duration_s']:.1f}"),
    ("throughput (req/s)", lambda s: f"{s['request_throughput']:.2f}"),
    ("output throughput (tok/s)", lambda s: f"{s['output_token_throughput']:.1f}"),
    ("prefix hit rate", _hit_rate),
    *[(f"TTFT {p} (ms)", _ms("ttft_ms", p)) for p in ("p50", "p90", "p99")],
    *[(f"ITL {p} (ms)", _ms("itl_ms", p)) for p in ("p50", "p90", "p99")],
    *[(f"end-to-end {p} (ms)", _ms("e2e_ms", p)) for p in ("p50", "p90", "p99")],
    ("workers (requests)", _workers),
]


def summary_table(reports: list[RunReport]) -> Table:
    table = Table(title="kvserve bench")
    table.add_column("metric")
    for report in reports:
        table.add_column(report.label, justify="right")
    for name, cell in ROWS:
        table.add_row(name, *(cell(r.summary) for r in reports))
    return table


def markdown_table(reports: list[RunReport]) -> str:
    lines = [
        "| metric | " + " | ".join(r.label for r in reports) + " |",
        "|---|" + "---:|" * len(reports),
    ]
    for name, cell in ROWS:
        lines.append(f"| {name} | " + " | ".join(cell(r.summary) for r in reports) + " |")
    return "\n".join(lines)


def error_lines(report: RunReport) -> list[str]:
    """One line per kind of error: how many, and the first message of that kind."""
    examples = report.summary.get("error_examples", {})
    return [
        f"errors `{kind}`: {count}" + (f" (e.g. {examples[kind]})" if kind in examples else "")
        for kind, count in report.summary["error_kinds"].items()
    ]


def write_markdown(
    reports: list[RunReport], plots: dict[str, Path], out_dir: Path, file: str
) -> Path:
    """The table, each run's configuration and errors, and the plots, in one page."""
    parts = ["# kvserve bench", "", markdown_table(reports), ""]
    for report in reports:
        parts.append(f"## {report.label}")
        parts += [f"- {key}: `{value}`" for key, value in report.config.items()]
        parts += [f"- {line}" for line in error_lines(report)]
        parts.append("")
    parts += [f"![{name}]({path.name})" for name, path in plots.items()]
    path = out_dir / file
    path.write_text("\n".join(parts) + "\n")
    return path
