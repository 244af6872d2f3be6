"""Per-request records and the figures computed from them.

Every figure is computed exactly from the records (no streaming estimates), so a report
can be recomputed from ``results.json`` alone and two runs compare like for like.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """One HTTP request: a completion, or one turn of a chat."""

    item: int  # index of the workload item
    turn: int  # chat turn (0 for completions)
    start_s: float  # when it was sent, seconds since the run started
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker: str | None = None  # x-kvserve-worker, when the server says
    policy: str | None = None  # the router policy named in x-kvserve-decision
    decision: str | None = None  # x-kvserve-decision whole: policy, reason, matched share
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def end_s(self) -> float:
        return self.start_s + (self.e2e_s or 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50/p90/p99 and mean, times ``scale`` (e.g. 1000 for ms); None when empty."""
    keys = [f"p{p}" for p in PERCENTILES] + ["mean"]
    if not values:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=float) * scale
    values_at = np.percentile(arr, PERCENTILES)
    out: dict[str, float | None] = {
        f"p{p}": float(v) for p, v in zip(PERCENTILES, values_at, strict=True)
    }
    out["mean"] = float(arr.mean())
    return out


def hit_rate(records: list[RequestRecord]) -> float | None:
    """Prefix hit rate: cached prompt tokens over prompt tokens, of successful requests."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else None


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """The run's summary: counts, rates, latency percentiles (ms), hit rate, workers."""
    ok = [r for r in records if r.ok]
    span = max(duration_s, 1e-9)
    completion = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "error_rate": (len(records) - len(ok)) / len(records) if records else 0.0,
        "duration_s": duration_s,
        "request_throughput": len(ok) / span,
        "output_token_throughput": completion / span,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "completion_tokens": completion,
        "prefix_hit_rate": hit_rate(records),
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None], 1000.0),
        "itl_ms": percentiles([gap for r in ok for gap in r.itl_s], 1000.0),
        "e2e_ms": percentiles([r.e2e_s for r in ok if r.e2e_s is not None], 1000.0),
        "requests_per_worker": requests_per_worker(ok),
        "error_kinds": dict(Counter(_error_kind(r.error) for r in records if r.error)),
        "error_examples": error_examples(records),
        "router_policies": dict(Counter(r.policy for r in records if r.policy)),
        "workers_seen": sorted({r.worker for r in records if r.worker}),
    }


def requests_per_worker(records: list[RequestRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.worker or "unknown" for r in records).items()))


def error_examples(records: list[RequestRecord]) -> dict[str, str]:
    """The first error message of each kind: what a reader needs to start looking."""
    examples: dict[str, str] = {}
    for record in records:
        if record.error:
            examples.setdefault(_error_kind(record.error), record.error)
    return examples


def _error_kind(error: str) -> str:
    """Groups errors by their leading words, before any detail after a colon."""
    return error.split(":", 1)[0]


@dataclass(frozen=True, slots=True)
class TimeSeries:
    """Per-bin figures by completion time: what the server delivered in each window."""

    bin_s: float
    starts_s: list[float]
    output_tokens_per_s: list[float]
    hit_rate: list[float | None]  # None for a bin where no request finished


def time_series(records: list[RequestRecord], duration_s: float, bins: int = 30) -> TimeSeries:
    """About ``bins`` bins over the run (``duration_s``, or longer if a request ended later)."""
    ok = [r for r in records if r.ok]
    end = max([duration_s, *(r.end_s for r in ok)])
    bin_s = round_up_125(end / bins) if end > 0 else 1.0
    count = max(1, int(np.ceil(end / bin_s)))
    index = np.minimum((np.asarray([r.end_s for r in ok]) / bin_s).astype(int), count - 1)
    tokens = np.zeros(count)
    prompt = np.zeros(count)
    cached = np.zeros(count)
    np.add.at(tokens, index, [r.completion_tokens for r in ok])
    np.add.at(prompt, index, [r.prompt_tokens for r in ok])
    np.add.at(cached, index, [r.cached_tokens for r in ok])
    return TimeSeries(
        bin_s=bin_s,
        starts_s=[i * bin_s for i in range(count)],
        output_tokens_per_s=(tokens / bin_s).tolist(),
        hit_rate=[float(c / p) if p else None for c, p in zip(cached, prompt, strict=True)],
    )


def round_up_125(raw: float) -> float:
    """Rounds up to 1, 2 or 5 times a power of ten, for readable axes."""
    magnitude = 10 ** np.floor(np.log10(raw))
    return float(next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw))
