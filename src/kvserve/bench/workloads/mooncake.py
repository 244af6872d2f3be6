"""Mooncake traces (FAST'25): arrival times, lengths and ``hash_ids`` of 512-token blocks.

Each hash id becomes one deterministic content block, so requests that share a
``hash_ids`` prefix share exactly that prompt prefix. ``block_tokens`` shrinks every
block (e.g. 512 → 16) for small test models while keeping the sharing structure.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvserve.bench.workloads.base import Prompt, RequestSpec, Workload
from kvserve.bench.workloads.content import ContentMaker

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class MooncakeRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_rows(path: Path, limit: int | None = None) -> list[MooncakeRow]:
    rows: list[MooncakeRow] = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            raw = json.loads(line)
            rows.append(
                MooncakeRow(
                    float(raw["timestamp"]),
                    int(raw["input_length"]),
                    int(raw["output_length"]),
                    tuple(raw["hash_ids"]),
                )
            )
    return rows


def load(
    path: Path,
    *,
    block_tokens: int = TRACE_BLOCK_TOKENS,
    mode: str = "text",
    vocab: int = 32000,
    max_tokens: int | None = None,
    limit: int | None = None,
) -> Workload:
    """``max_tokens`` caps the trace's output lengths; ``mode`` is ``text`` or ``tokens``."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    rows = read_rows(path, limit)
    maker = ContentMaker(mode, vocab)
    start_ms = rows[0].timestamp_ms if rows else 0.0

    def to_spec(row: MooncakeRow) -> RequestSpec:
        output = row.output_length if max_tokens is None else min(row.output_length, max_tokens)
        return RequestSpec(
            arrival_s=(row.timestamp_ms - start_ms) / 1000.0,
            max_tokens=max(1, output),
            prompt=prompt_for(row, maker, block_tokens),
        )

    name = f"mooncake:{path.name}"
    return Workload(name, timed=True, size=len(rows), requests=map(to_spec, rows))


def prompt_for(row: MooncakeRow, maker: ContentMaker, block_tokens: int) -> Prompt:
    """Full blocks for every hash id but the last, which holds the rest of the input."""
    if not row.hash_ids:
        raise ValueError("a Mooncake row needs at least one hash id")
    scaled_input = math.ceil(row.input_length * block_tokens / TRACE_BLOCK_TOKENS)
    last_len = scaled_input - (len(row.hash_ids) - 1) * block_tokens
    last_len = min(max(last_len, 1), block_tokens)
    pieces = [maker.block(f"mooncake:{h}", block_tokens) for h in row.hash_ids[:-1]]
    pieces.append(maker.block(f"mooncake:{row.hash_ids[-1]}", last_len))
    return maker.join(pieces)
