"""Shared system prompts: each request is one of ``n_prefixes`` long prefixes plus a
suffix of its own. Fewer prefixes, or longer ones, mean more reuse to find."""

from __future__ import annotations

import random

from kvserve.bench.workloads.base import Workload, capped
from kvserve.bench.workloads.content import BlockKeys, block_prompts


def generate(
    *,
    requests: int = 256,
    n_prefixes: int = 8,
    prefix_len: int = 1024,
    suffix_len: int = 64,
    max_tokens: int = 32,
    mode: str = "text",
    vocab: int = 32000,
    seed: int = 0,
    limit: int | None = None,
) -> Workload:
    if n_prefixes < 1:
        raise ValueError(f"n_prefixes must be >= 1, got {n_prefixes}")
    rng = random.Random(seed)

    def blocks_of(index: int) -> BlockKeys:
        prefix = f"shared-prefix:{seed}:prefix:{rng.randrange(n_prefixes)}"
        return [(prefix, prefix_len), (f"shared-prefix:{seed}:suffix:{index}", suffix_len)]

    count = capped(requests, limit)
    return block_prompts(
        "shared-prefix", count, blocks_of, max_tokens=max_tokens, mode=mode, vocab=vocab
    )
