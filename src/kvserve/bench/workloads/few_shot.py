"""Few-shot prompts: ``shots`` examples drawn from a pool of ``pool``, in pool order,
then a question of the request's own.

Because examples keep pool order, two prompts share a prefix as long as their leading
examples coincide: a small pool gives long shared prefixes, a large one short and rare
ones — partial sharing, unlike the all-or-nothing shared-prefix source.
"""

from __future__ import annotations

import random

from kvserve.bench.workloads.base import Workload, capped
from kvserve.bench.workloads.content import BlockKeys, block_prompts


def generate(
    *,
    requests: int = 128,
    pool: int = 16,
    shots: int = 4,
    shot_len: int = 128,
    question_len: int = 32,
    max_tokens: int = 32,
    mode: str = "text",
    vocab: int = 32000,
    seed: int = 0,
    limit: int | None = None,
) -> Workload:
    if not 1 <= shots <= pool:
        raise ValueError(f"need 1 <= shots <= pool, got shots={shots}, pool={pool}")
    rng = random.Random(seed)

    def blocks_of(index: int) -> BlockKeys:
        chosen = sorted(rng.sample(range(pool), shots))
        examples = [(f"few-shot:{seed}:example:{i}", shot_len) for i in chosen]
        return [*examples, (f"few-shot:{seed}:question:{index}", question_len)]

    count = capped(requests, limit)
    return block_prompts(
        "few-shot", count, blocks_of, max_tokens=max_tokens, mode=mode, vocab=vocab
    )
