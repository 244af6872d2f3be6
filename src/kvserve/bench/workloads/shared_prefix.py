"""Shared system prompts: each request is one of ``n_prefixes`` long prefixes plus a
suffix of its own. Fewer prefixes, or longer ones, mean more reuse to find.

``popularity_skew`` makes some prefixes hot, as in a fleet where one product's system
prompt carries most of the traffic: prefix ``k`` is drawn with weight ``1 / (k + 1) ** s``
(Zipf). A hot prefix is where a router must choose between its holder's queue and a
second copy; with ``s = 0`` every prefix is equally likely."""

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
    popularity_skew: float = 0.0,
    seed: int = 0,
    limit: int | None = None,
) -> Workload:
    if n_prefixes < 1:
        raise ValueError(f"n_prefixes must be >= 1, got {n_prefixes}")
    if popularity_skew < 0:
        raise ValueError(f"popularity_skew must be >= 0, got {popularity_skew}")
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** popularity_skew for k in range(n_prefixes)]

    def pick_prefix() -> int:
        if popularity_skew == 0:  # the draw every earlier workload of this seed made
            return rng.randrange(n_prefixes)
        return rng.choices(range(n_prefixes), weights)[0]

    def blocks_of(index: int) -> BlockKeys:
        prefix = f"shared-prefix:{seed}:prefix:{pick_prefix()}"
        return [(prefix, prefix_len), (f"shared-prefix:{seed}:suffix:{index}", suffix_len)]

    count = capped(requests, limit)
    return block_prompts(
        "shared-prefix", count, blocks_of, max_tokens=max_tokens, mode=mode, vocab=vocab
    )
