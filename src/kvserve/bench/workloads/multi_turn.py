"""Multi-turn conversations: each turn resends the whole history with the server's real
answers, so turn ``k`` can reuse the KV of turns ``1..k-1``; conversations also share
one of ``systems`` system prompts."""

from __future__ import annotations

from kvserve.bench.workloads.base import RequestSpec, Workload, capped
from kvserve.bench.workloads.content import text_block


def generate(
    *,
    conversations: int = 16,
    turns: int = 4,
    systems: int = 1,
    system_len: int = 256,
    user_len: int = 64,
    max_tokens: int = 32,
    seed: int = 0,
    limit: int | None = None,
) -> Workload:
    if turns < 1 or systems < 1:
        raise ValueError(f"need turns >= 1 and systems >= 1, got {turns}, {systems}")
    count = capped(conversations, limit)
    specs = [
        RequestSpec(
            arrival_s=0.0,
            max_tokens=max_tokens,
            system=(
                text_block(f"multi-turn:{seed}:system:{c % systems}", system_len)
                if system_len
                else None
            ),
            user_turns=tuple(
                text_block(f"multi-turn:{seed}:user:{c}:{t}", user_len) for t in range(turns)
            ),
        )
        for c in range(count)
    ]
    return Workload("multi-turn", timed=False, size=count, requests=specs)
