"""MT-bench: 80 real two-turn chats; the second turn carries the first answer."""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.bench.workloads.base import RequestSpec, Workload


def load(path: Path, *, max_tokens: int = 256, limit: int | None = None) -> Workload:
    specs: list[RequestSpec] = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(specs) >= limit:
                break
            if line.strip():
                turns = tuple(json.loads(line)["turns"])
                specs.append(RequestSpec(arrival_s=0.0, max_tokens=max_tokens, user_turns=turns))
    return Workload("mt-bench", timed=False, size=len(specs), requests=specs)
