"""Fills ``RouteQuery.blocks`` for the policies that read them (kv_aware), off the
router's event loop.

The tokenizer that turns a request into the block hashes a worker will compute is
``--tokenizer DIR``, else the folder named by the model a worker serves when that is a
local folder; the block size is the one the workers' KV snapshots give (learned by the
:class:`~kvserve.router.kv_event_subscriber.KVEventSubscriber`). Encoding is awaited
with the tokenizers library's async encode, once per request before any load guard is
taken, so a client leaving meanwhile leaves nothing held. Without a tokenizer or before
the first snapshot, ``blocks`` stays None and the policy routes by load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvserve.core.routing.types import RouteQuery
from kvserve.router.kv_event_subscriber import WorkerKVInfo
from kvserve.router.prompt_tokens import PromptHasher


class PromptPreparer:
    def __init__(self, tokenizer_dir: str | None = None) -> None:
        self._fixed_hasher = PromptHasher(tokenizer_dir) if tokenizer_dir else None
        self._hashers: dict[str, PromptHasher | None] = {}  # by served model name
        self._block_size: int | None = None

    def learn_worker(self, worker_id: str, info: WorkerKVInfo) -> None:
        """A worker's block size and served models, from its KV snapshot."""
        self._block_size = info.block_size
        for model in info.models:
            if model not in self._hashers and self._fixed_hasher is None:
                local = Path(model).is_dir()
                self._hashers[model] = PromptHasher.load(model) if local else None

    async def prepare(self, query: RouteQuery) -> RouteQuery:
        """``query`` with its prompt's blocks, when they can be known."""
        hasher = self._fixed_hasher or self._hashers.get(query.model)
        block_size = self._block_size  # read once: an event may change it while we wait
        if hasher is None or block_size is None or query.body is None:
            return query
        blocks = await hasher.blocks_async(query.body, block_size)
        return dataclasses.replace(query, blocks=blocks)
