"""Azure LLM inference traces (2023): real arrival times and token counts, no prefixes.

Each request gets content of its own (keyed by its row), so the trace measures load
and length effects without accidental sharing.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvserve.bench.workloads.base import RequestSpec, Workload
from kvserve.bench.workloads.content import ContentMaker


def _seconds(timestamp: str) -> float:
    # The trace writes 7 fractional digits; datetime parses at most 6.
    date_part, _, fraction = timestamp.partition(".")
    whole = datetime.strptime(date_part, "%Y-%m-%d %H:%M:%S")
    return whole.timestamp() + (float("0." + fraction) if fraction else 0.0)


@dataclass(frozen=True, slots=True)
class AzureRow:
    arrival_s: float  # since the trace's first request
    context_tokens: int
    generated_tokens: int


def read_rows(path: Path, limit: int | None = None) -> list[AzureRow]:
    """The trace's rows in file order (``TIMESTAMP``, ``ContextTokens``,
    ``GeneratedTokens``), arrivals relative to the first row."""
    raw_rows: list[tuple[float, int, int]] = []
    with path.open(newline="") as f:
        for raw in csv.DictReader(f):
            if limit is not None and len(raw_rows) >= limit:
                break
            raw_rows.append(
                (_seconds(raw["TIMESTAMP"]), int(raw["ContextTokens"]), int(raw["GeneratedTokens"]))
            )
    start = raw_rows[0][0] if raw_rows else 0.0
    return [AzureRow(t - start, context, generated) for t, context, generated in raw_rows]


def load(
    path: Path,
    *,
    input_scale: float = 1.0,
    mode: str = "text",
    vocab: int = 32000,
    max_tokens: int | None = None,
    limit: int | None = None,
) -> Workload:
    """``input_scale`` shrinks prompt lengths; ``max_tokens`` caps output lengths."""
    if input_scale <= 0:
        raise ValueError(f"input_scale must be > 0, got {input_scale}")
    rows = read_rows(path, limit)
    maker = ContentMaker(mode, vocab)

    def to_spec(index: int) -> RequestSpec:
        row = rows[index]
        length = max(1, math.ceil(row.context_tokens * input_scale))
        generated = row.generated_tokens
        output = generated if max_tokens is None else min(generated, max_tokens)
        return RequestSpec(
            arrival_s=row.arrival_s,
            max_tokens=max(1, output),
            prompt=maker.block(f"azure:{path.name}:{index}", length),
        )

    return Workload(
        f"azure:{path.name}", timed=True, size=len(rows), requests=map(to_spec, range(len(rows)))
    )
