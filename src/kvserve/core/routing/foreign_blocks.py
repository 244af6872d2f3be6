"""One foreign worker's blocks (vLLM, SGLang) renamed into kvserve's block hashes.

The router's index is keyed by kvserve's chain hash, which the router computes itself
from a prompt's tokens. A vLLM engine names blocks by its own hash, whose algorithm and
seed are the engine's settings (SHA-256 of pickled tuples by default, xxhash seeded at
random when ``PYTHONHASHSEED`` is unset). Reproducing it would tie the router to one
engine version and setting and fail outright for a random seed. But every
``BlockStored`` carries the blocks' token ids, so the router hashes those with its own
chain and keeps a map from the engine's names to its own for ``BlockRemoved``. Then any
engine, hash algorithm or seed works, and one index serves kvserve and foreign workers.

What changes KV content besides tokens goes into the chain's namespace, as kvserve's
engine does: the name a client addresses (the served model, or the LoRA adapter's name)
and the ``cache_salt`` that vLLM lists among block 0's ``extra_keys``. Multimodal keys
are folded in as well, so an image prompt's blocks never look like a text prompt's. A
continued chain inherits its parent's namespace.

A ``BlockStored`` whose parent this map does not know (its events were lost, or the map
was dropped and is being rebuilt from new events) cannot be named: it is counted in
``unnamed_blocks`` and skipped, which makes the index under-report that worker, never
over-report it.
"""

from __future__ import annotations

from typing import Any

from kvserve.core.hashing import block_hashes, make_namespace
from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.kv_index import TIERS
from kvserve.core.vllm_kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    VllmEvent,
    block_count_ok,
    stored_tier,
)


def _salt_and_rest(event: BlockStored) -> tuple[str | None, tuple[Any, ...]]:
    """Block 0's cache salt, and every extra key that is neither the salt nor the LoRA
    name (multimodal identifiers, prompt-embedding digests) of any block."""
    salt = None
    rest: list[Any] = []
    for index, keys in enumerate(event.extra_keys or ()):
        if not keys:
            continue
        strings = [k for k in keys if isinstance(k, str)]
        if event.lora_name is not None and strings and strings[0] == event.lora_name:
            strings = strings[1:]
        if index == 0 and event.parent_block_hash is None and strings:
            salt = strings[-1]
            strings = strings[:-1]
        rest.extend(strings)
        rest.extend(k for k in keys if not isinstance(k, str))
    return salt, tuple(rest)


class ForeignBlockMap:
    """Engine hash → (kvserve hash, namespace), per tier, for one foreign worker."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._names: dict[tuple[str, EngineHash], tuple[int, bytes]] = {}
        self.unnamed_blocks = 0
        self.block_size: int | None = None

    def __len__(self) -> int:
        return len(self._names)

    def clear(self) -> None:
        self._names.clear()

    def translate(self, seq: int, event: VllmEvent) -> list[KVEvent]:
        """The index events for one engine event (none when nothing can be named)."""
        if isinstance(event, BlockStored):
            return self._stored(seq, event)
        if isinstance(event, BlockRemoved):
            tier = stored_tier(event.medium)
            names = self._names
            removed = [names.pop((tier, h))[0] for h in event.block_hashes if (tier, h) in names]
            return [KVEvent(seq, "removed", tier, tuple(removed))] if removed else []
        assert isinstance(event, AllBlocksCleared)
        self._names.clear()
        return [KVEvent(seq, "cleared", tier, ()) for tier in TIERS]

    def _stored(self, seq: int, event: BlockStored) -> list[KVEvent]:
        if not block_count_ok(event):
            self.unnamed_blocks += len(event.block_hashes)
            return []
        self.block_size = event.block_size
        tier = stored_tier(event.medium)
        if event.parent_block_hash is None:
            parent: int | None = None
            salt, rest = _salt_and_rest(event)
            namespace = make_namespace(event.lora_name or self.model, None, salt)
            if rest:
                namespace += b"\x00extra\x00" + repr(rest).encode("utf-8")
        else:
            known = self._names.get((tier, event.parent_block_hash))
            if known is None:
                self.unnamed_blocks += len(event.block_hashes)
                return []
            parent, namespace = known
            _, rest = _salt_and_rest(event)
            if rest:  # a later block's own multimodal keys: a namespace of its own
                namespace += b"\x00extra\x00" + repr(rest).encode("utf-8")
        ours = block_hashes(event.token_ids, event.block_size, namespace, parent)
        for engine_hash, own in zip(event.block_hashes, ours, strict=True):
            self._names[(tier, engine_hash)] = (own, namespace)
        return [KVEvent(seq, "stored", tier, tuple(ours), parent)]
