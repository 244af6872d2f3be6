"""Foreign blocks renamed into kvserve's chain hash: the names match what the router
computes for the same tokens whatever the engine called them, a block of another size or
under an unknown parent stays unnamed, and multimodal keys keep image prompts apart."""

from __future__ import annotations

from kvserve.core.hashing import block_hashes, make_namespace
from kvserve.core.routing.foreign_blocks import ForeignBlockMap
from kvserve.core.vllm_kv_wire import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4
TOKENS = list(range(10, 10 + 3 * BS))


def ours(tokens: list[int], namespace: bytes = make_namespace("m")) -> list[int]:
    return block_hashes(tokens, BS, namespace)


def test_the_same_tokens_get_the_same_names_whatever_the_engine_hash() -> None:
    for engine_names in ((1, 2, 3), (b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32)):
        blocks = ForeignBlockMap("m")
        (stored,) = blocks.translate(1, BlockStored(engine_names[:2], None, tuple(TOKENS[:8]), BS))
        assert list(stored.block_hashes) == ours(TOKENS)[:2] and stored.parent_hash is None
        tail_tokens = tuple(TOKENS[8:])
        (tail,) = blocks.translate(
            2, BlockStored(engine_names[2:], engine_names[1], tail_tokens, BS)
        )
        assert list(tail.block_hashes) == ours(TOKENS)[2:] and tail.parent_hash == ours(TOKENS)[1]
        # Offloaded to the CPU, announced by hash alone: named from the device's copy.
        (offloaded,) = blocks.translate(
            3, BlockStored(engine_names[:1], None, (), BS, medium="CPU")
        )
        assert offloaded.tier == "host" and list(offloaded.block_hashes) == ours(TOKENS)[:1]
        (removed,) = blocks.translate(4, BlockRemoved((engine_names[0], 999)))
        assert removed.tier == "device" and removed.block_hashes == (ours(TOKENS)[0],)
        (removed,) = blocks.translate(5, BlockRemoved((engine_names[0],), medium="CPU"))
        assert removed.tier == "host" and len(blocks) == 2
        cleared = blocks.translate(6, AllBlocksCleared())
        assert {e.kind for e in cleared} == {"cleared"} and len(blocks) == 0


def test_unknown_parents_and_other_block_sizes_stay_unnamed() -> None:
    blocks = ForeignBlockMap("m")
    assert blocks.translate(1, BlockStored((7,), 6, tuple(TOKENS[:BS]), BS)) == []
    assert blocks.translate(2, BlockStored((1,), None, tuple(TOKENS[:BS]), BS)) != []
    assert blocks.translate(3, BlockStored((2,), 1, (5, 6), 2)) == []  # a partial page
    assert blocks.translate(4, BlockStored((3,), 1, (5, 6, 7), BS)) == []  # short of tokens
    assert blocks.unnamed_blocks == 3 and blocks.block_size == BS


def test_multimodal_keys_keep_an_image_prompt_apart_from_text() -> None:
    blocks = ForeignBlockMap("m")
    image = [["img-sha", 0]]  # vLLM: (mm identifier, offset) per block that holds it
    (stored,) = blocks.translate(
        1, BlockStored((1,), None, tuple(TOKENS[:BS]), BS, extra_keys=image)
    )
    assert list(stored.block_hashes) != ours(TOKENS[:BS])
