"""The engine's gauges, read on the engine thread after each iteration.

The HTTP loop must never wait for a running step to learn the load, so the engine
thread copies these few numbers into an immutable value that ``/load`` and ``/metrics``
read for free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineState:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    evictable_blocks: int = 0  # cached and pinned by no request: free for the taking
    total_blocks: int = 0
    prefill_tokens: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    events_last_seq: int = 0
    kv_tiers: tuple[tuple[str, int], ...] = ()  # the connectors' metrics (the KV tiers' only)
    threads: int = 0  # intra-op threads of the model
    short_waits: bool = False  # they sleep at once between ops: the cores are shared
    wait_changes: int = 0  # times the thread governor changed that

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    def load(self) -> dict[str, int]:
        """The ``/load`` body: what a router needs to weigh this worker."""
        return {
            "running": self.running,
            "waiting": self.waiting,
            "free_blocks": self.free_blocks,
            "cached_blocks": self.cached_blocks,
            "evictable_blocks": self.evictable_blocks,
            "total_blocks": self.total_blocks,
            "prefill_tokens": self.prefill_tokens,
        }


def probe_engine(engine: Any) -> EngineState:
    """Reads an ``LLMEngine``; call only on the engine's own thread."""
    load = engine.load()
    prefix_cache = engine.scheduler.stats  # each request counted once, at admission
    threads, short_waits, wait_changes = engine.runner.intra_op_threads()
    return EngineState(
        running=load["running"],
        waiting=load["waiting"],
        free_blocks=load["free_blocks"],
        cached_blocks=load["cached_blocks"],
        evictable_blocks=load["evictable_blocks"],
        total_blocks=load["total_blocks"],
        prefill_tokens=load["prefill_tokens"],
        prefix_queried_tokens=prefix_cache.prompt_tokens,
        prefix_hit_tokens=prefix_cache.cached_prompt_tokens,
        preemptions=load.get("preemptions", 0),
        events_last_seq=engine.events.last_seq,
        kv_tiers=tuple(engine.connector_metrics().items()),
        threads=threads,
        short_waits=short_waits,
        wait_changes=wait_changes,
    )
