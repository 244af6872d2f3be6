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
    """Engine hash → (kvserve hash, namespace) for one foreign worker, and the tiers that
    hold each block. A name does not depend on the tier, so a block copied to another
    tier (vLLM's CPU offload announces it by hash alone) is named from the first."""

    def __init__(self, model: str, block_size: int | None = None) -> None:
        self.model = model
        self._names: dict[EngineHash, tuple[int, bytes]] = {}
        self._tiers: dict[EngineHash, set[str]] = {}
        self.unnamed_blocks = 0
        # the first BlockStored's, unless given; blocks of another size (SGLang's partial
        # last page) cannot match a prompt hashed at this size and stay unnamed
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self._names)

    def clear(self) -> None:
        self._names.clear()
        self._tiers.clear()

    def translate(self, seq: int, event: VllmEvent) -> list[KVEvent]:
        """The index events for one engine event (none when nothing can be named)."""
        if isinstance(event, BlockStored):
            return self._stored(seq, event)
        if isinstance(event, BlockRemoved):
            return self._removed(seq, event)
        assert isinstance(event, AllBlocksCleared)
        self.clear()
        return [KVEvent(seq, "cleared", tier, ()) for tier in TIERS]

    def _removed(self, seq: int, event: BlockRemoved) -> list[KVEvent]:
        tier = stored_tier(event.medium)
        removed = []
        for engine_hash in event.block_hashes:
            tiers = self._tiers.get(engine_hash)
            if tiers is None or tier not in tiers:
                continue
            removed.append(self._names[engine_hash][0])
            tiers.discard(tier)
            if not tiers:
                del self._tiers[engine_hash], self._names[engine_hash]
        return [KVEvent(seq, "removed", tier, tuple(removed))] if removed else []

    def _stored(self, seq: int, event: BlockStored) -> list[KVEvent]:
        tier = stored_tier(event.medium)
        named = self._named(event)
        if named is None:
            self.unnamed_blocks += len(event.block_hashes)
            return []
        ours, parent = named
        for engine_hash in event.block_hashes:
            self._tiers.setdefault(engine_hash, set()).add(tier)
        return [KVEvent(seq, "stored", tier, tuple(ours), parent)]

    def _named(self, event: BlockStored) -> tuple[list[int], int | None] | None:
        """Our names for the event's blocks and their parent, None when unknowable."""
        names = self._names
        parent_name = (
            None if event.parent_block_hash is None else names.get(event.parent_block_hash)
        )
        if event.parent_block_hash is not None and parent_name is None:
            return None
        parent = None if parent_name is None else parent_name[0]
        if event.block_hashes and all(h in names for h in event.block_hashes):
            return [names[h][0] for h in event.block_hashes], parent  # held on another tier
        if self.block_size is None:
            self.block_size = event.block_size
        if not block_count_ok(event) or event.block_size != self.block_size:
            return None
        salt, rest = _salt_and_rest(event)
        if parent_name is None:
            namespace = make_namespace(event.lora_name or self.model, None, salt)
        else:
            namespace = parent_name[1]
        if rest:  # multimodal keys: a namespace no text prompt has
            namespace += b"\x00extra\x00" + repr(rest).encode("utf-8")
        ours = block_hashes(event.token_ids, event.block_size, namespace, parent)
        for engine_hash, own in zip(event.block_hashes, ours, strict=True):
            names[engine_hash] = (own, namespace)
        return ours, parent
