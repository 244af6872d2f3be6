"""KV cache operations at scale: match + insert of a prompt, batched eviction.

For block ledgers whose prefix trees hold 10^4, 10^5 and 10^6 cached blocks (all
unpinned, free pool empty, as in a warm server), measures:

- match + insert of a 128-block prompt whose first 64 blocks are cached (a recent
  prompt's prefix) and last 64 are new: the two tree operations a prefill publishes;
  and the whole request cycle around them (allocate 64 blocks, which evicts 64 LRU
  blocks because the pool is empty, then release all 128 pins);
- eviction of 10,000 blocks in one call, in two tree shapes: chains of 128 blocks (each
  eviction exposes a parent) and flat (every block a leaf, so the LRU heap holds the
  whole tree: its worst case).

Beside match + insert runs a floor measured the same way: the bare dict operations any
hash-keyed index needs for that prompt (128 lookups, 64 inserts) on a plain dict of the
same size. Past the CPU caches both slow down with n; the ratio between them shows how
much of that growth is the memory hierarchy rather than the algorithm. Each size is
printed with its ratio to the smallest size next to log2(n) / log2(n0), the growth an
O(log n) operation is allowed. Medians over ``--repeats`` prompts and
``--evictions`` eviction calls; the garbage collector runs as it would in a server.
Times are this thread's CPU time by default, so that other processes sharing the
machine do not inflate them; ``--clock wall`` measures elapsed time instead.

Run: ``python benchmarks/cache_ops.py [--sizes 10000 100000 1000000]``
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


def random_chain(rng: random.Random, length: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(length)]


def publish(ledger: BlockLedger, hashes: list[int]) -> None:
    blocks = ledger.allocate(len(hashes))
    ledger.insert(hashes, blocks)
    ledger.unpin(blocks[::-1])


def filled_ledger(num_cached: int, chain_length: int, rng: random.Random) -> BlockLedger:
    """A ledger of exactly ``num_cached`` blocks, all cached and unpinned."""
    ledger = BlockLedger(num_cached, BLOCK_SIZE)
    while ledger.num_free_blocks:
        publish(ledger, random_chain(rng, min(chain_length, ledger.num_free_blocks)))
    return ledger


Clock = Callable[[], int]
CLOCKS: dict[str, Clock] = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}


def time_prompts(
    ledger: BlockLedger, repeats: int, rng: random.Random, clock: Clock
) -> dict[str, float]:
    """Median µs of match+insert and of the whole cycle; share of prefix blocks hit."""
    recent: deque[list[int]] = deque(maxlen=RECENT_PROMPTS)
    recent.append(random_chain(rng, PROMPT_BLOCKS))
    publish(ledger, recent[0])
    tree_ns: list[int] = []
    cycle_ns: list[int] = []
    hits = 0
    for _ in range(repeats):
        new_part = random_chain(rng, PROMPT_BLOCKS - SHARED_BLOCKS)
        prompt = rng.choice(recent)[:SHARED_BLOCKS] + new_part
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
        recent.append(prompt)
    return {
        "match_insert_us": statistics.median(tree_ns) / 1e3,
        "cycle_us": statistics.median(cycle_ns) / 1e3,
        "hit_share": hits / (repeats * SHARED_BLOCKS),
    }


def time_dict_floor(size: int, repeats: int, rng: random.Random, clock: Clock) -> float:
    """Median µs of a prompt's bare dict work on a dict of ``size`` keys (kept constant)."""
    index = {key: 0 for key in random_chain(rng, size)}
    oldest = deque(index)
    recent: deque[list[int]] = deque([random_chain(rng, PROMPT_BLOCKS)], maxlen=RECENT_PROMPTS)
    durations: list[int] = []
    for _ in range(repeats):
        new_part = random_chain(rng, PROMPT_BLOCKS - SHARED_BLOCKS)
        prompt = rng.choice(recent)[:SHARED_BLOCKS] + new_part
        get = index.get
        started = clock()
        for key in prompt:
            get(key)
        for key in new_part:
            index.setdefault(key, 1)
        durations.append(clock() - started)
        for _ in new_part:
            del index[oldest.popleft()]
        oldest.extend(new_part)
        recent.append(prompt)
    return statistics.median(durations) / 1e3


def time_evictions(
    ledger: BlockLedger, calls: int, chain_length: int, rng: random.Random, clock: Clock
) -> float:
    """Median ms of one ``evict(EVICT_BLOCKS)``; the tree is refilled between calls."""
    durations: list[int] = []
    for _ in range(calls):
        started = clock()
        evicted = ledger.evict(EVICT_BLOCKS)
        durations.append(clock() - started)
        assert evicted == EVICT_BLOCKS, evicted
        while ledger.num_free_blocks:
            publish(ledger, random_chain(rng, min(chain_length, ledger.num_free_blocks)))
    return statistics.median(durations) / 1e6


def growth(value: float, base: float, size: int, base_size: int) -> str:
    allowed = math.log2(size) / math.log2(base_size)
    return f"x{value / base:4.2f} (log allows x{allowed:4.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=2_000, help="prompts per size")
    parser.add_argument("--evictions", type=int, default=7, help="eviction calls per size")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    rng = random.Random(args.seed)
    rows = []
    for size in args.sizes:
        ledger = filled_ledger(size, PROMPT_BLOCKS, rng)
        prompts = time_prompts(ledger, args.repeats, rng, clock)
        prompts["floor_us"] = time_dict_floor(size, args.repeats, rng, clock)
        ledger.check()
        chains_ms = time_evictions(ledger, args.evictions, PROMPT_BLOCKS, rng, clock)
        flat_ms = time_evictions(filled_ledger(size, 1, rng), args.evictions, 1, rng, clock)
        rows.append((size, prompts, chains_ms, flat_ms))
        print(
            f"n={size:>9,}  match+insert {prompts['match_insert_us']:6.1f} µs "
            f"(dict floor {prompts['floor_us']:5.1f} µs)  "
            f"cycle {prompts['cycle_us']:6.1f} µs  prefix hit {prompts['hit_share']:.0%}  "
            f"evict 10k: chains {chains_ms:5.2f} ms, flat {flat_ms:5.2f} ms",
            flush=True,
        )
    base_size, base, base_chains, base_flat = rows[0]
    print(f"\ngrowth from n={base_size:,}:")
    for size, prompts, chains_ms, flat_ms in rows[1:]:
        print(
            f"n={size:>9,}  match+insert "
            f"{growth(prompts['match_insert_us'], base['match_insert_us'], size, base_size)}  "
            f"dict floor x{prompts['floor_us'] / base['floor_us']:4.2f}  "
            f"evict chains {growth(chains_ms, base_chains, size, base_size)}  "
            f"flat {growth(flat_ms, base_flat, size, base_size)}"
        )


if __name__ == "__main__":
    main()
