"""Prompt logprobs (echo) and sampled tokens' logprobs equal ``transformers``'
log-softmax on the same weights within 1e-3, on every tiny architecture and both attention
paths: cold, with the prompt's prefix cached by an earlier request, and in a pool so small
that requests are preempted mid-prompt and mid-generation."""

from __future__ import annotations

import json
import math
import random
from functools import cache

import pytest
import torch
import transformers

from kvserve.core.sampling_params import SamplingParams
from kvserve.core.structured_output import StructuredOutput
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.logprobs import TokenLogprob
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.tiny_model import ARCHES

BLOCK_SIZE = 4
TOLERANCE = 1e-3
TOP = 5


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 900) for _ in range(length)]


PROMPTS = [random_prompt(n, seed) for seed, n in enumerate((2, 19, 40, 77))]


@pytest.fixture(scope="module", params=ARCHES)
def model_dir(request, tiny_model_dirs, attention_path):
    return tiny_model_dirs[request.param]


@pytest.fixture(scope="module")
def oracle(model_dir, device):
    """Log-softmax of transformers' logits at every position of a token sequence."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device)

    @cache
    def logprobs(tokens: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([tokens], device=device)).logits[0].float().cpu()
        return torch.log_softmax(logits, dim=-1)

    return logprobs


def collect(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, list[RequestOutput]] = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            results[output.request_id].append(output)
        engine.kv_cache.check()
    assert engine.kv_cache.num_available_blocks == engine.kv_cache.num_blocks
    return results


def assert_close(found: TokenLogprob, expected: torch.Tensor, token: int, top: int = TOP) -> None:
    assert found.token_id == token and len(found.top) == top
    assert abs(found.logprob - expected[token].item()) < TOLERANCE
    best = expected.topk(len(found.top))
    assert [t for t, _ in found.top] == best.indices.tolist()
    for (_, value), want in zip(found.top, best.values.tolist(), strict=True):
        assert abs(value - want) < TOLERANCE


def check_prompt_logprobs(outputs: list[RequestOutput], prompt: list[int], oracle) -> None:
    firsts = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(firsts) == 1 and outputs[0].prompt_logprobs is not None, "on the first output"
    found = firsts[0]
    assert len(found) == len(prompt) and found[0] is None
    expected = oracle(tuple(prompt))
    for position in range(1, len(prompt)):
        entry = found[position]
        assert entry is not None
        assert_close(entry, expected[position - 1], prompt[position])


def check_sample_logprobs(
    outputs: list[RequestOutput], prompt: list[int], oracle, top: int = TOP
) -> None:
    tokens = [t for o in outputs for t in o.new_token_ids]
    found = [lp for o in outputs for lp in (o.logprobs or [])]
    assert len(found) == len(tokens) > 0
    expected = oracle(tuple(prompt + tokens))
    for i, (entry, token) in enumerate(zip(found, tokens, strict=True)):
        assert_close(entry, expected[len(prompt) - 1 + i], token, top)


ECHO = SamplingParams(max_tokens=0, prompt_logprobs=TOP)
BOTH = SamplingParams(
    temperature=0, max_tokens=6, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP
)


def test_echo_without_generation_and_with(model_dir, oracle, device):
    engine = LLMEngine(
        model_dir, block_size=BLOCK_SIZE, num_blocks=256, dtype="float32", device=device
    )
    requests = {f"echo-{i}": (p, ECHO) for i, p in enumerate(PROMPTS)}
    requests |= {f"both-{i}": (p, BOTH) for i, p in enumerate(PROMPTS)}
    results = collect(engine, requests)
    for i, prompt in enumerate(PROMPTS):
        echo = results[f"echo-{i}"]
        assert echo[-1].finish_reason == "length" and echo[-1].completion_tokens == 0
        check_prompt_logprobs(echo, prompt, oracle)
        check_prompt_logprobs(results[f"both-{i}"], prompt, oracle)
        check_sample_logprobs(results[f"both-{i}"], prompt, oracle)


def test_cached_prefix_is_recomputed_for_prompt_logprobs(model_dir, oracle, device):
    """A cached block holds K/V, not logits: an echo request computes its whole prompt
    (cached_tokens 0) and is exact; a later plain request still reuses the cache."""
    engine = LLMEngine(
        model_dir, block_size=BLOCK_SIZE, num_blocks=256, dtype="float32", device=device
    )
    prompt = PROMPTS[3]
    collect(engine, {"warm": (prompt, SamplingParams(max_tokens=1))})
    computed = engine.scheduler.stats.computed_tokens
    results = collect(engine, {"echo": (prompt, BOTH)})
    assert results["echo"][-1].num_cached_tokens == 0
    assert engine.scheduler.stats.computed_tokens - computed == len(prompt) + BOTH.max_tokens - 1
    check_prompt_logprobs(results["echo"], prompt, oracle)
    check_sample_logprobs(results["echo"], prompt, oracle)
    plain = collect(engine, {"plain": (prompt, SamplingParams(max_tokens=1, logprobs=0))})
    assert plain["plain"][-1].num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    check_sample_logprobs(plain["plain"], prompt, oracle, top=0)


def test_after_preemption(model_dir, oracle, device):
    engine = LLMEngine(
        model_dir,
        block_size=BLOCK_SIZE,
        num_blocks=30,
        max_num_batched_tokens=16,
        dtype="float32",
        device=device,
    )
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP
    )
    prompts = [*PROMPTS[1:], random_prompt(30, 9)]
    results = collect(engine, {f"p-{i}": (p, params) for i, p in enumerate(prompts)})
    assert engine.scheduler.stats.preemptions > 0
    for i, prompt in enumerate(prompts):
        check_prompt_logprobs(results[f"p-{i}"], prompt, oracle)
        check_sample_logprobs(results[f"p-{i}"], prompt, oracle)


def test_structured_output_logprobs_are_the_unmasked_ones(model_dir, oracle, device):
    """The sampler masks the logits in place for a grammar; logprobs are taken before,
    so they are finite and are the model's own log-softmax (top alternatives include
    tokens the grammar forbade), while the tokens still follow the grammar. A free
    request in the same batch is unaffected by its neighbours' masks."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["calm", "windy"]}},
        "required": ["ok", "mood"],
        "additionalProperties": False,
    }
    structured = StructuredOutput(json.dumps(schema))
    engine = LLMEngine(
        model_dir, block_size=BLOCK_SIZE, num_blocks=256, dtype="float32", device=device
    )
    prompt = PROMPTS[2]
    requests = {
        "greedy": (prompt, SamplingParams(temperature=0, max_tokens=60, logprobs=TOP,
                                          structured_output=structured)),
        "seeded": (prompt, SamplingParams(seed=5, max_tokens=60, logprobs=TOP,
                                          structured_output=structured)),
        "free": (PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                            logprobs=TOP)),
    }  # fmt: skip
    results = collect(engine, requests)
    for request_id in ("greedy", "seeded"):
        outputs = results[request_id]
        assert outputs[-1].finish_reason == "stop"
        assert json.loads("".join(o.new_text for o in outputs)).keys() == {"ok", "mood"}
        entries = [lp for o in outputs for lp in (o.logprobs or [])]
        assert all(math.isfinite(e.logprob) for e in entries)
        assert all(math.isfinite(v) for e in entries for _, v in e.top)
        check_sample_logprobs(outputs, prompt, oracle)
    check_sample_logprobs(results["free"], PROMPTS[1], oracle)
