"""Exact KV-aware routing, fed by the workers' KV events.

The rule and the index are pure (:mod:`kvserve.core.routing.kv_aware`); this shell adds
what needs the outside world: the tokenizer that turns a request into the block hashes a
worker will compute (``--tokenizer DIR``, else the folder named by the model a worker
serves when that is a local folder) and the event subscriber that keeps the index.
Tokenizing happens in ``prepare``, awaited off the router's event loop (the tokenizers
library's async encode); ``select`` reads the hashes from the prepared query. Without a
tokenizer or before the first snapshot gives the block size, requests go to the
least-loaded worker and say so (``reason=no_tokenizer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import aiohttp

from kvserve.core.routing.kv_aware import KvAwareConfig, KvAwareRouting
from kvserve.core.routing.tie_breaking import Rotation, least_loaded
from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad
from kvserve.router.kv_event_subscriber import KVEventSubscriber, WorkerKVInfo
from kvserve.router.policies.base import Policy
from kvserve.router.prompt_tokens import PromptBlocks, PromptHasher
from kvserve.router.worker_registry import WorkerRegistry


@dataclass(frozen=True, slots=True)
class HashedQuery(RouteQuery):
    """A query with its prompt's block hashes, computed by ``prepare`` (None: no
    tokenizer, no block size yet, or a body the worker would refuse)."""

    blocks: PromptBlocks | None = field(default=None, compare=False, repr=False)
    block_size: int | None = None


class KvAwarePolicy(Policy):
    name = "kv_aware"

    def __init__(self, config: KvAwareConfig, tokenizer_dir: str | None = None) -> None:
        self.routing = KvAwareRouting(config)
        self._fixed_hasher = PromptHasher(tokenizer_dir) if tokenizer_dir else None
        self._hashers: dict[str, PromptHasher | None] = {}  # by served model name
        self._block_size: int | None = None
        self._rotation = Rotation()
        self.subscriber: KVEventSubscriber | None = None

    def subscribe(
        self, registry: WorkerRegistry, session: aiohttp.ClientSession
    ) -> KVEventSubscriber:
        """The subscriber that keeps this policy's index; the caller runs and stops it."""
        self.subscriber = KVEventSubscriber(
            self.routing.index,
            registry,
            session,
            on_worker_info=self.learn_worker,
            on_forget=self.routing.forget_worker,
        )
        return self.subscriber

    def learn_worker(self, worker_id: str, info: WorkerKVInfo) -> None:
        self._block_size = info.block_size
        for model in info.models:
            if model not in self._hashers and self._fixed_hasher is None:
                local = Path(model).is_dir()
                self._hashers[model] = PromptHasher.load(model) if local else None

    async def prepare(self, query: RouteQuery) -> HashedQuery:
        hasher = self._fixed_hasher or self._hashers.get(query.model)
        block_size = self._block_size  # read once: an event may change it while we wait
        blocks = None
        if hasher is not None and block_size is not None and query.body is not None:
            blocks = await hasher.blocks_async(query.body, block_size)
        return HashedQuery(
            **{f.name: getattr(query, f.name) for f in fields(RouteQuery)},
            blocks=blocks,
            block_size=block_size,
        )

    def select(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], now: float
    ) -> RoutingDecision:
        blocks = query.blocks if isinstance(query, HashedQuery) else None
        if blocks is None or query.block_size is None:
            chosen = least_loaded(workers, self._rotation)
            return RoutingDecision(chosen.worker_id, self.name, "no_tokenizer")
        choice = self.routing.route(
            workers, blocks.reusable_hashes, blocks.num_tokens, query.block_size, now
        )
        matched = choice.prediction.cached_tokens / blocks.num_tokens
        return RoutingDecision(choice.worker_id, self.name, choice.reason, matched)

    def forget_worker(self, worker_id: str) -> None:
        self.routing.forget_worker(worker_id)
        if self.subscriber is not None:
            self.subscriber.reconcile()  # stop following it now, not at the next tick
