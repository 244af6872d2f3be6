"""Few-shot prompts: ``shots`` examples drawn from a pool of ``pool``, in pool order,
then a question of the request's own.

Because examples keep pool order, two prompts share a prefix as long as their leading
examples coincide: a small pool gives long shared prefixes, a large one short and rare
ones — partial sharing, unlike the all-or-nothing shared-prefix source.
"""

from __future__ import annotations

import random

from kvserve.bench.workloads.base import Workload, capped, untimed_prompts
from kvserve.bench.workloads.content import ContentMaker


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
    maker = ContentMaker(mode, vocab)
    rng = random.Random(seed)
    prompts = []
    for index in range(capped(requests, limit)):
        chosen = sorted(rng.sample(range(pool), shots))
        pieces = [maker.block(f"few-shot:{seed}:example:{i}", shot_len) for i in chosen]
        pieces.append(maker.block(f"few-shot:{seed}:question:{index}", question_len))
        prompts.append(maker.join(pieces))
    return untimed_prompts("few-shot", prompts, max_tokens)
