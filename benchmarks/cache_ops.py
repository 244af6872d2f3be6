"""KV cache operations at scale: match + insert of a prompt, batched eviction.

For block ledgers whose prefix trees hold 10^4, 10^5 and 10^6 cached blocks (all
unpinned, free pool empty, as in a warm server), measures:

- match + insert of a 128-block prompt whose first 64 blocks are cached (a recent
  prompt's prefix) and last 64 are new: the two tree operations a prefill publishes;
  and the whole request cycle around them (allocate 64 blocks, which evicts 64 LRU
  blocks because the pool is empty, then release all 128 pins);
- eviction of 10,000 blocks in one call, in two tree shapes: chains of 128 blocks (each
  eviction exposes a parent) and flat (every block a leaf, the most candidates).

Beside match + insert runs a floor measured the same way: the bare dict operations any
hash-keyed index needs for that prompt (128 lookups, 64 inserts) on a plain dict of the
same size. Past the CPU caches both slow down with n; the ratio between them shows how
much of that growth is the memory hierarchy rather than the algorithm. Each size is
printed with its ratio to the smallest size next to log2(n) / log2(n0), the growth an
O(log n) operation is allowed.

All sizes are built first, then measured in rounds that alternate between them, so that
noise from other jobs on the machine hits every size alike; figures are medians over all
rounds. The garbage collector runs as it would in a server. Times are this thread's CPU
time by default, so that other processes do not inflate them; ``--clock wall`` measures
elapsed time instead.

Run: ``python benchmarks/cache_ops.py [--sizes 10000 100000 1000000] [--rounds 10]``
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable

from kvserve.core.block_ledger import BlockLedger

PROMPT_BLOCKS = 128
SHARED_BLOCKS = 64
EVICT_BLOCKS = 10_000
BLOCK_SIZE = 16
RECENT_PROMPTS = 256  # prompts whose prefixes a new prompt may share (still cached)

Clock = Callable[[], int]
CLOCKS: dict[str, Clock] = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}


def random_chain(rng: random.Random, length: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(length)]


class PromptSource:
    """128-block prompts: a recent prompt's first 64 blocks, then 64 new ones."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.recent: deque[list[int]] = deque(maxlen=RECENT_PROMPTS)

    def next(self) -> list[int]:
        rng = self.rng
        shared = rng.choice(self.recent)[:SHARED_BLOCKS] if self.recent else []
        prompt = shared + random_chain(rng, PROMPT_BLOCKS - len(shared))
        self.recent.append(prompt)
        return prompt


class LedgerWorkload:
    """A ledger kept full of ``size`` cached, unpinned blocks."""

    def __init__(self, size: int, chain_length: int, rng: random.Random) -> None:
        self.ledger = BlockLedger(size, BLOCK_SIZE)
        self.chain_length = chain_length
        self.rng = rng
        self.prompts = PromptSource(rng)
        self.refill()
        self.publish(self.prompts.next())

    def publish(self, hashes: list[int]) -> None:
        blocks = self.ledger.allocate(len(hashes))
        self.ledger.insert(hashes, blocks)
        self.ledger.unpin(blocks[::-1])

    def refill(self) -> None:
        ledger = self.ledger
        while ledger.num_free_blocks:
            length = min(self.chain_length, ledger.num_free_blocks)
            self.publish(random_chain(self.rng, length))

    def run_prompts(self, count: int, clock: Clock) -> tuple[list[int], list[int], int]:
        """Per prompt: ns of match+insert, ns of the whole cycle; and blocks hit."""
        ledger = self.ledger
        tree_ns: list[int] = []
        cycle_ns: list[int] = []
        hits = 0
        for _ in range(count):
            prompt = self.prompts.next()
            t0 = clock()
            matched = ledger.match(prompt)
            t1 = clock()
            num_matched = len(matched)
            blocks = ledger.allocate(PROMPT_BLOCKS - num_matched)
            parent_hash = prompt[num_matched - 1] if num_matched else None
            t2 = clock()
            inserted = ledger.insert(prompt[num_matched:], blocks, parent_hash)
            t3 = clock()
            ledger.unpin((matched + inserted)[::-1])
            t4 = clock()
            tree_ns.append(t1 - t0 + t3 - t2)
            cycle_ns.append(t4 - t0)
            hits += num_matched
        return tree_ns, cycle_ns, hits

    def evict_once(self, clock: Clock) -> int:
        """ns of one ``evict(EVICT_BLOCKS)``; the tree is refilled afterwards."""
        started = clock()
        evicted = self.ledger.evict(EVICT_BLOCKS)
        elapsed = clock() - started
        assert evicted == EVICT_BLOCKS, evicted
        self.refill()
        return elapsed


class DictFloor:
    """A plain dict of ``size`` hash keys doing a prompt's bare index work."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.index = dict.fromkeys(random_chain(rng, size), 0)
        self.oldest = deque(self.index)
        self.prompts = PromptSource(rng)

    def run_prompts(self, count: int, clock: Clock) -> list[int]:
        index = self.index
        get = index.get
        durations: list[int] = []
        for _ in range(count):
            prompt = self.prompts.next()
            new_part = prompt[SHARED_BLOCKS:]
            started = clock()
            for key in prompt:
                get(key)
            for key in new_part:
                index.setdefault(key, 1)
            durations.append(clock() - started)
            for _ in new_part:  # keep the size constant, outside the timing
                del index[self.oldest.popleft()]
            self.oldest.extend(new_part)
        return durations


def growth(value: float, base: float, size: int, base_size: int) -> str:
    allowed = math.log2(size) / math.log2(base_size)
    return f"x{value / base:4.2f} (log allows x{allowed:4.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=200, help="prompts per size and round")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    rng = random.Random(args.seed)
    print("building trees ...", flush=True)
    chains = {size: LedgerWorkload(size, PROMPT_BLOCKS, rng) for size in args.sizes}
    flats = {size: LedgerWorkload(size, 1, rng) for size in args.sizes}
    floors = {size: DictFloor(size, rng) for size in args.sizes}
    samples: dict[int, dict[str, list[int]]] = {
        size: {"tree": [], "cycle": [], "floor": [], "chains": [], "flat": [], "hits": []}
        for size in args.sizes
    }
    for _ in range(args.rounds):
        for size in args.sizes:
            tree_ns, cycle_ns, hits = chains[size].run_prompts(args.prompts, clock)
            got = samples[size]
            got["tree"] += tree_ns
            got["cycle"] += cycle_ns
            got["hits"].append(hits)
            got["floor"] += floors[size].run_prompts(args.prompts, clock)
            got["chains"].append(chains[size].evict_once(clock))
            got["flat"].append(flats[size].evict_once(clock))
    for workload in (*chains.values(), *flats.values()):
        workload.ledger.check()
    rows = []
    for size in args.sizes:
        got = samples[size]
        row = {key: statistics.median(got[key]) for key in ("tree", "cycle", "floor")}
        row = {key: value / 1e3 for key, value in row.items()}  # µs
        row["chains"] = statistics.median(got["chains"]) / 1e6  # ms
        row["flat"] = statistics.median(got["flat"]) / 1e6
        hit_share = sum(got["hits"]) / (args.rounds * args.prompts * SHARED_BLOCKS)
        rows.append((size, row))
        print(
            f"n={size:>9,}  match+insert {row['tree']:6.1f} µs "
            f"(dict floor {row['floor']:5.1f} µs)  cycle {row['cycle']:6.1f} µs  "
            f"prefix hit {hit_share:.0%}  "
            f"evict 10k: chains {row['chains']:5.2f} ms, flat {row['flat']:5.2f} ms"
        )
    base_size, base = rows[0]
    print(f"\ngrowth from n={base_size:,} ({args.clock} time):")
    for size, row in rows[1:]:
        print(
            f"n={size:>9,}  match+insert {growth(row['tree'], base['tree'], size, base_size)}  "
            f"dict floor x{row['floor'] / base['floor']:4.2f}  "
            f"evict chains {growth(row['chains'], base['chains'], size, base_size)}  "
            f"flat {growth(row['flat'], base['flat'], size, base_size)}"
        )


if __name__ == "__main__":
    main()
