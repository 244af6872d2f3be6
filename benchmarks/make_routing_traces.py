"""Two synthetic traces in Mooncake's JSONL format, for routing beyond conversations.

- ``agentic_sessions.jsonl``: agent sessions of many short-thinking turns. Each session
  runs one of a few agent kinds, whose long instructions and tool list every session of
  that kind shares; each turn resends the whole context plus the last tool output, so a
  session's prompt grows turn by turn, seconds apart.
- ``bursty_system_prompts.jsonl``: bursts of requests that share one of a few system
  prompts (popularity by Zipf), each followed by a question of its own; bursts are a
  second long and start at random, so a prefix goes from cold to hot at once.

Every 512-token block is a ``hash_id`` (equal ids, equal content), as in Mooncake's own
traces, which ``kvserve simulate --trace`` reads. Seeded: the same files every run.

Run: ``python benchmarks/make_routing_traces.py OUT_DIR [--seed 0]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path

BLOCK = 512


class _Blocks:
    """Fresh block ids, never reused."""

    def __init__(self) -> None:
        self._ids = itertools.count()

    def take(self, tokens: int) -> list[int]:
        return list(itertools.islice(self._ids, -(-tokens // BLOCK)))


def _row(at_s: float, input_tokens: int, output_tokens: int, hash_ids: list[int]) -> str:
    return json.dumps(
        {
            "timestamp": round(at_s * 1000),
            "input_length": input_tokens,
            "output_length": output_tokens,
            "hash_ids": hash_ids,
        }
    )


def agentic_sessions(rng: random.Random, sessions: int, duration_s: float) -> Iterator[str]:
    """Sessions start uniformly over ``duration_s``; turns 2–8 s apart."""
    blocks = _Blocks()
    kinds = [blocks.take(rng.choice([4096, 6144, 8192])) for _ in range(6)]
    rows: list[tuple[float, str]] = []
    for _ in range(sessions):
        context = list(rng.choice(kinds))  # whole blocks: turns append whole blocks
        at = rng.uniform(0, duration_s)
        for _ in range(rng.randint(4, 24)):
            context += blocks.take(rng.choice([512, 1024, 1536, 2048]))  # tool output
            tokens = len(context) * BLOCK
            rows.append((at, _row(at, tokens, rng.randint(64, 320), list(context))))
            at += rng.uniform(2.0, 8.0)
    rows.sort(key=lambda r: r[0])
    yield from (row for _, row in rows)


def bursty_system_prompts(rng: random.Random, bursts: int, duration_s: float) -> Iterator[str]:
    """Bursts of 10–80 requests within a second, on one of 40 system prompts (Zipf)."""
    blocks = _Blocks()
    prompts = [blocks.take(rng.choice([2048, 4096, 6144])) for _ in range(40)]
    weights = [1 / (rank + 1) for rank in range(len(prompts))]
    rows: list[tuple[float, str]] = []
    for _ in range(bursts):
        system = rng.choices(prompts, weights)[0]
        start = rng.uniform(0, duration_s)
        for _ in range(rng.randint(10, 80)):
            question = blocks.take(rng.choice([256, 512, 1024]))
            ids = system + question
            at = start + rng.uniform(0, 1.0)
            rows.append((at, _row(at, len(ids) * BLOCK, rng.randint(64, 400), ids)))
    rows.sort(key=lambda r: r[0])
    yield from (row for _, row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    traces = {
        "agentic_sessions.jsonl": agentic_sessions(random.Random(args.seed), 1200, 1800.0),
        "bursty_system_prompts.jsonl": bursty_system_prompts(random.Random(args.seed), 300, 1800.0),
    }
    for name, rows in traces.items():
        path = args.out / name
        path.write_text("".join(f"{row}\n" for row in rows))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
