"""n choices of one prompt are forked sequences over its KV blocks, not n prefills: checked
in the block ledger of a real engine behind a real engine thread bridge, in-process."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvserve.core.hashing import block_hashes
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.worker.choices import ChoicePlan, ChoiceSet
from kvserve.worker.engine_bridge import EngineBridge
from kvserve.worker.engine_state import probe_engine

BLOCK_SIZE = 16
PROMPT_TOKENS = 2000
N = 4
MAX_TOKENS = 24


@pytest.fixture
def engine(tiny_model_dir: Path) -> LLMEngine:
    torch.set_num_threads(1)
    return LLMEngine(tiny_model_dir, block_size=BLOCK_SIZE, num_blocks=200, device="cpu")


def plans(prompt: list[int], n: int) -> list[ChoicePlan]:
    """As the worker plans them: choice i seeded ``seed + i``, forked from choice 0."""
    return [
        ChoicePlan(
            i,
            0,
            prompt,
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=7 + i),
            None if i == 0 else 0,
        )
        for i in range(n)
    ]


async def test_n4_on_a_2000_token_prompt_allocates_its_blocks_once(engine: LLMEngine) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(10, 900) for _ in range(PROMPT_TOKENS)]
    bridge = EngineBridge(engine, probe_engine)
    bridge.start()
    choices = ChoiceSet(bridge, "fork", plans(prompt, N))
    await choices.start()
    seen: set[int] = set()
    ledger: dict[str, object] = {}
    finished = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(N)}

    def read_ledger(e: LLMEngine) -> None:
        kv = e.kv_cache
        kv.check()
        blocks = kv.lookup_prefix(block_hashes(prompt, BLOCK_SIZE, e.namespace))
        ledger["prompt_blocks"] = blocks
        ledger["ref_counts"] = [kv.ref_count(b) for b in blocks]
        ledger["used"] = kv.num_blocks - kv.num_free_blocks
        ledger["tables"] = [kv.block_table(choices.engine_request_id(i)) for i in range(N)]

    async for index, output in choices.outputs():
        if index not in seen:
            seen.add(index)
            if len(seen) == N:  # every choice is running: look at the ledger between steps
                await bridge.call(read_ledger)
        tokens[index] += output.new_token_ids
        if output.finished:
            finished[index] = output
    await bridge.shutdown()

    full_blocks = PROMPT_TOKENS // BLOCK_SIZE
    assert len(ledger["prompt_blocks"]) == full_blocks
    # Every block of the prompt is one block, pinned by all four choices.
    assert ledger["ref_counts"] == [N] * full_blocks
    tables = ledger["tables"]
    shared = (PROMPT_TOKENS - 1) // BLOCK_SIZE  # blocks matched by the forks
    for table in tables:
        assert table[:shared] == tables[0][:shared] == ledger["prompt_blocks"][:shared]
    # Besides the prompt: per fork its own copy of the last prompt block (computed again
    # to get its logits) and a block or two of output each; never a second prompt.
    assert ledger["used"] <= full_blocks + (N - 1) + N * 2
    assert [finished[i].num_cached_tokens for i in range(N)] == [0] + [shared * BLOCK_SIZE] * 3
    computed = engine.scheduler.stats.computed_tokens
    tail = PROMPT_TOKENS - shared * BLOCK_SIZE
    assert computed == PROMPT_TOKENS + (N - 1) * tail + N * (MAX_TOKENS - 1)
    assert len({tuple(t) for t in tokens.values()}) == N  # each choice its own seed
