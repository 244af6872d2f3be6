"""Trace requests as the simulator replays them: arrival, lengths, and prompt token ids.

Mooncake traces give each 512-token block of a prompt as a ``hash_id`` (equal ids, equal
content). The simulator's KV block is the trace's block (512 tokens), and block ``h`` is
512 copies of token id ``h``: distinct ids make distinct blocks, equal ids equal ones, so
the engine's own hash chain (:mod:`kvserve.core.hashing`) over these tokens keeps the
trace's sharing exactly, at a cost of one list repeat per block (the bench's random
content per block would spend minutes in the RNG on the full trace). The last block holds
the rest of the input, so a prompt has exactly ``input_length`` tokens.

Azure traces (CSV) carry arrivals and lengths but no content: each request gets block ids
of its own, so nothing is shared and every policy's hit rate is zero — they measure load
and length effects only, and the report says so.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from kvserve.bench.workloads import azure
from kvserve.bench.workloads.mooncake import TRACE_BLOCK_TOKENS, read_rows

BLOCK_TOKENS = TRACE_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    session_key: str | None = None  # the conversation it belongs to, when the trace says

    def prompt_token_ids(self) -> list[int]:
        """One block of ``BLOCK_TOKENS`` copies of each hash id; the last one short."""
        tokens: list[int] = []
        last = len(self.hash_ids) - 1
        for index, hash_id in enumerate(self.hash_ids):
            length = self.input_tokens - last * BLOCK_TOKENS if index == last else BLOCK_TOKENS
            tokens.extend([hash_id] * max(1, min(length, BLOCK_TOKENS)))
        return tokens


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: list[TraceRequest]  # in arrival order
    shares_prefixes: bool  # False: no two requests share a block (Azure), hit rate is 0


def load_trace(path: Path, *, limit: int | None = None, speedup: float = 1.0) -> Trace:
    """A Mooncake JSONL trace, or an Azure CSV trace, by the file's suffix."""
    if path.suffix == ".csv":
        return Trace(path.name, load_azure(path, limit=limit, speedup=speedup), False)
    return Trace(path.name, load_mooncake(path, limit=limit, speedup=speedup), True)


def load_azure(path: Path, *, limit: int | None = None, speedup: float = 1.0) -> list[TraceRequest]:
    """The trace's requests in arrival order, each with block ids no other request has."""
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, got {speedup}")
    try:
        rows = azure.read_rows(path, limit)
    except (KeyError, ValueError) as error:
        raise ValueError(f"{path}: not an Azure trace CSV ({error})") from error
    if not rows:
        raise ValueError(f"{path}: no requests")
    fresh_ids = itertools.count()
    requests = []
    for index, row in enumerate(rows):
        input_tokens = max(1, row.context_tokens)
        blocks = math.ceil(input_tokens / BLOCK_TOKENS)
        requests.append(
            TraceRequest(
                request_id=f"r{index}",
                arrival_s=row.arrival_s / speedup,
                input_tokens=input_tokens,
                output_tokens=max(1, row.generated_tokens),
                hash_ids=tuple(itertools.islice(fresh_ids, blocks)),
            )
        )
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def load_mooncake(
    path: Path, *, limit: int | None = None, speedup: float = 1.0
) -> list[TraceRequest]:
    """The trace's requests in arrival order; ``speedup`` > 1 compresses arrival times
    (the same requests at a higher rate)."""
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, got {speedup}")
    rows = read_rows(path, limit)
    if not rows:
        raise ValueError(f"{path}: no requests")
    start_ms = rows[0].timestamp_ms
    requests = [
        TraceRequest(
            request_id=f"r{index}",
            arrival_s=(row.timestamp_ms - start_ms) / 1000.0 / speedup,
            input_tokens=max(1, row.input_length),
            output_tokens=max(1, row.output_length),
            hash_ids=row.hash_ids,
        )
        for index, row in enumerate(rows)
        if row.hash_ids
    ]
    requests.sort(key=lambda r: r.arrival_s)
    return requests
