"""Greedy output of the engine equals ``transformers``' ``generate``, token for token, on
tiny random models of each architecture: with mixed prompt lengths, with prefix-cache
hits, with chunked prefill under a small token budget, and with a KV pool so small that
requests are preempted. The block ledger is checked after every engine step."""

from __future__ import annotations

import random
from functools import cache

import pytest
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.tiny_model import ARCHES

transformers = pytest.importorskip("transformers", reason="transformers is the test oracle")

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK_SIZE = 4


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(length)]


FIRST_BATCH = [random_prompt(n, seed) for seed, n in enumerate((3, 17, 33, 64, 101))]
# Long shared prefixes with the first batch: a cut inside a block, a prompt that extends a
# whole earlier prompt, and one that shares only its first block.
SECOND_BATCH = [
    FIRST_BATCH[3][:50] + random_prompt(9, 10),
    FIRST_BATCH[4] + random_prompt(20, 11),
    FIRST_BATCH[2][:6] + random_prompt(30, 12),
]


@pytest.fixture(scope="module", params=ARCHES)
def model_dir(request, tiny_model_dirs, attention_path):
    return tiny_model_dirs[request.param]


@pytest.fixture(scope="module")
def oracle(model_dir, device):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device)
    config = transformers.GenerationConfig(
        max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )

    @cache
    def greedy(prompt: tuple[int, ...]) -> list[int]:
        out = model.generate(torch.tensor([prompt], device=device), generation_config=config)
        return out[0, len(prompt) :].tolist()

    return greedy


def run_checked(engine: LLMEngine, prompts: list[list[int]], tag: str) -> dict[int, dict]:
    """Run the prompts together, checking the ledger after every step."""
    results = {i: {"tokens": [], "cached": None} for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, GREEDY)
    while engine.has_unfinished_requests():
        for output in engine.step():
            result = results[int(output.request_id.rsplit("-", 1)[1])]
            result["tokens"] += output.new_token_ids
            if output.finished:
                result["cached"] = output.num_cached_tokens
        engine.kv_cache.check()
    kv = engine.kv_cache
    assert kv.num_available_blocks == kv.num_blocks, "a block is still held"
    return results


def assert_matches_oracle(results, prompts, oracle) -> None:
    for i, prompt in enumerate(prompts):
        assert results[i]["tokens"] == oracle(tuple(prompt)), f"prompt {i}"


def test_mixed_lengths_then_shared_prefixes(model_dir, oracle, device):
    engine = LLMEngine(
        model_dir, block_size=BLOCK_SIZE, num_blocks=512, dtype="float32", device=device
    )
    first = run_checked(engine, FIRST_BATCH, "first")
    assert_matches_oracle(first, FIRST_BATCH, oracle)
    computed_before = engine.scheduler.stats.computed_tokens

    second = run_checked(engine, SECOND_BATCH, "second")
    assert_matches_oracle(second, SECOND_BATCH, oracle)
    assert [second[i]["cached"] for i in range(3)] == [48, 100, 4]
    # Cold, each request computes its prompt and all but its last generated token.
    cold_cost = sum(len(p) + MAX_TOKENS - 1 for p in SECOND_BATCH)
    assert engine.scheduler.stats.computed_tokens - computed_before == cold_cost - (48 + 100 + 4)


def test_chunked_prefill_with_a_small_budget(model_dir, oracle, device):
    engine = LLMEngine(
        model_dir,
        block_size=BLOCK_SIZE,
        num_blocks=512,
        max_num_batched_tokens=7,
        dtype="float32",
        device=device,
    )
    assert_matches_oracle(run_checked(engine, FIRST_BATCH, "chunked"), FIRST_BATCH, oracle)


def test_preemption_in_a_tiny_pool(model_dir, oracle, device):
    engine = LLMEngine(
        model_dir, block_size=BLOCK_SIZE, num_blocks=36, dtype="float32", device=device
    )
    prompts = FIRST_BATCH + SECOND_BATCH[:1]
    results = run_checked(engine, prompts, "tiny")
    assert engine.scheduler.stats.preemptions > 0
    assert_matches_oracle(results, prompts, oracle)
