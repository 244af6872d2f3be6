"""LLMEngine as the worker drives it: incremental outputs, stop rules, aborts, load, and
per-request errors that leave the other requests running."""

from __future__ import annotations

import pytest

from kvserve.core.sampling_params import InvalidParameterError, SamplingParams
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.llm_engine import LLMEngine

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture
def engine(tiny_model_dirs) -> LLMEngine:
    return LLMEngine(tiny_model_dirs["qwen2"], block_size=4, num_blocks=128)


def drain(engine: LLMEngine) -> dict[str, list]:
    """All outputs per request id, checking the ledger after every step."""
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        engine.kv_cache.check()
    return outputs


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, **kwargs)


def generate(engine: LLMEngine, params: SamplingParams, prompt=PROMPT) -> list:
    engine.add_request("r", prompt, params)
    return drain(engine)["r"]


def joined(outputs) -> tuple[str, list[int]]:
    return "".join(o.new_text for o in outputs), [t for o in outputs for t in o.new_token_ids]


def test_outputs_are_incremental_and_add_up(engine):
    outputs = generate(engine, greedy(max_tokens=12, ignore_eos=True))
    assert [o.completion_tokens for o in outputs] == list(range(1, 13))
    assert all(len(o.new_token_ids) == 1 for o in outputs)
    assert [o.finished for o in outputs] == [False] * 11 + [True]
    assert outputs[-1].finish_reason == "length"
    assert {o.prompt_tokens for o in outputs} == {len(engine.tokenizer.encode(PROMPT))}
    text, tokens = joined(outputs)
    assert text == engine.tokenizer.decode(tokens)


def test_stop_string_cuts_the_text_and_streams_nothing_past_it(engine):
    full_text, _ = joined(generate(engine, greedy(max_tokens=20, ignore_eos=True)))
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    outputs = generate(engine, greedy(max_tokens=20, ignore_eos=True, stop=[stop, "\x00never"]))
    text, _ = joined(outputs)
    assert text == full_text[: full_text.index(stop)]
    assert outputs[-1].finish_reason == "stop"


def test_stop_token_ids_and_min_tokens(engine):
    _, tokens = joined(generate(engine, greedy(max_tokens=8, ignore_eos=True)))
    stop_at = tokens[2]
    _, stopped = joined(generate(engine, greedy(max_tokens=8, stop_token_ids=[stop_at])))
    assert stopped == tokens[: tokens.index(stop_at) + 1]
    held = generate(engine, greedy(max_tokens=8, stop_token_ids=[tokens[0]], min_tokens=3))
    _, held_tokens = joined(held)
    assert tokens[0] not in held_tokens[:3]
    assert len(held_tokens) >= 3


def test_eos_stops_unless_ignored(engine):
    _, tokens = joined(generate(engine, greedy(max_tokens=8, ignore_eos=True)))
    engine.eos_token_ids = frozenset({tokens[3]})
    outputs = generate(engine, greedy(max_tokens=8))
    assert joined(outputs)[1] == tokens[: tokens.index(tokens[3]) + 1]
    assert outputs[-1].finish_reason == "stop"
    assert joined(generate(engine, greedy(max_tokens=8, ignore_eos=True)))[1] == tokens


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    _, alone = joined(generate(engine, params))
    engine.add_request("other", "Hello! How are you today?", SamplingParams(max_tokens=15))
    engine.add_request("r", PROMPT, params)
    engine.add_request("greedy", PROMPT + " Again.", greedy(max_tokens=5))
    assert joined(drain(engine)["r"])[1] == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=10, ignore_eos=True)
    assert joined(generate(engine, other_seed))[1] != alone


def test_abort_frees_blocks_at_once_and_ends_the_request(engine):
    engine.add_request("a", PROMPT, greedy(max_tokens=50))
    engine.add_request("b", PROMPT + " More.", greedy(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.abort_request("a")
    engine.abort_request("a")  # twice, and an unknown id: no error
    engine.abort_request("never-added")
    engine.kv_cache.check()
    outputs = drain(engine)
    assert set(outputs) == {"b"} and outputs["b"][-1].finished
    assert engine.kv_cache.num_available_blocks == engine.kv_cache.num_blocks


def test_load_reports_the_queue_and_the_pool(engine):
    assert engine.load() == {
        "running": 0,
        "waiting": 0,
        "free_blocks": 128,
        "cached_blocks": 0,
        "evictable_blocks": 0,
        "total_blocks": 128,
        "prefill_tokens": 0,
        "preemptions": 0,
    }
    engine.add_request("a", list(range(10, 30)), greedy(max_tokens=2))
    assert engine.load()["waiting"] == 1 and engine.load()["prefill_tokens"] == 20
    engine.step()
    load = engine.load()
    assert (load["running"], load["waiting"], load["prefill_tokens"]) == (1, 0, 0)
    assert load["free_blocks"] == 128 - 5 and load["cached_blocks"] == 5
    assert load["evictable_blocks"] == 0  # pinned by the running request: no headroom
    assert engine.events.last_seq > 0  # committing the blocks emitted events
    drain(engine)
    assert engine.load()["evictable_blocks"] == engine.load()["cached_blocks"] == 5


@pytest.mark.parametrize(
    ("prompt", "params", "param", "message"),
    [
        (list(range(10, 600)), greedy(), "prompt", "context holds 512"),
        ([], greedy(), "prompt", "empty"),
        ([10, 10**6], greedy(), "prompt", "outside the vocabulary"),
        (PROMPT, "max_tokens=0", "max_tokens", "max_tokens"),
        (PROMPT, greedy(stop_token_ids=[10**6]), "stop_token_ids", "vocabulary size"),
    ],
)
def test_bad_request_fails_alone(engine, prompt, params, param, message):
    engine.add_request("good", PROMPT, greedy(max_tokens=4, ignore_eos=True))
    engine.step()
    if params == "max_tokens=0":
        params = greedy()
        params.max_tokens = 0  # a caller mutated validated params
    with pytest.raises(InvalidRequestError, match=message) as excinfo:
        engine.add_request("bad", prompt, params)
    assert excinfo.value.param == param
    assert isinstance(excinfo.value, InvalidParameterError)
    outputs = drain(engine)
    assert set(outputs) == {"good"} and outputs["good"][-1].completion_tokens == 4
    assert engine.kv_cache.num_available_blocks == engine.kv_cache.num_blocks


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("a", PROMPT, greedy(max_tokens=2))
    with pytest.raises(InvalidRequestError) as excinfo:
        engine.add_request("a", PROMPT, greedy(max_tokens=2))
    assert excinfo.value.param == "request_id"


def test_unlimited_max_tokens_runs_to_the_end_of_the_context(tiny_model_dirs):
    engine = LLMEngine(tiny_model_dirs["qwen2"], block_size=4, num_blocks=10)
    assert engine.max_model_len == 40
    outputs = generate(engine, greedy(max_tokens=None, ignore_eos=True), prompt=[10] * 30)
    assert outputs[-1].completion_tokens == 10
    assert outputs[-1].finish_reason == "length"
