"""One salted prompt, three namers: the router's hashes of a request body, the names it
gives a vLLM engine's salted blocks, and a kvserve engine request's chain must agree, or
kv_aware would predict hits that never happen (or miss real ones)."""

from __future__ import annotations

from kvserve.core.hashing import HashChain, make_namespace, salted
from kvserve.core.routing.foreign_blocks import ForeignBlockMap
from kvserve.core.vllm_kv_wire import BlockStored
from kvserve.router.prompt_tokens import prompt_blocks

BS = 4
TOKENS = list(range(100, 100 + 3 * BS + 1))  # three full blocks and the last token
FULL = tuple(TOKENS[: 3 * BS])


def router_names(salt: str | None) -> list[int]:
    body = {"model": "m", "prompt": TOKENS, **({} if salt is None else {"cache_salt": salt})}
    blocks = prompt_blocks(body, TOKENS, BS)
    assert blocks is not None
    return blocks.reusable_hashes


def kvserve_names(salt: str | None) -> list[int]:
    """As ``LLMEngine.add_request`` names a request's blocks."""
    return HashChain(salted(make_namespace("m"), salt), BS).extend_to(TOKENS)


def vllm_names(salt: str | None) -> list[int]:
    """vLLM lists the salt among block 0's extra keys only."""
    extra = None if salt is None else ([salt], None, None)
    event = BlockStored((1, 2, 3), None, FULL, BS, extra_keys=extra)
    (stored,) = ForeignBlockMap("m").translate(1, event)
    return list(stored.block_hashes)


def test_the_router_a_kvserve_engine_and_a_vllm_engine_name_salted_blocks_alike() -> None:
    for salt in (None, "tenant-a", "tenant-b"):
        assert router_names(salt) == kvserve_names(salt) == vllm_names(salt)
    assert router_names("") == router_names(None)  # an empty salt is no salt
    names = [set(router_names(s)) for s in (None, "tenant-a", "tenant-b")]
    assert not names[0] & names[1] and not names[1] & names[2] and not names[0] & names[2]
