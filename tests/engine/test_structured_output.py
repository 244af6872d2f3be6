"""Constrained decoding in the engine: random-weight models emit JSON that fits the schema,
the grammar decides where the output ends, and a refused schema or a grammar failing
mid-generation ends only its own request and gives every block back."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from kvserve.core.sampling_params import InvalidParameterError, SamplingParams
from kvserve.core.structured_output import StructuredOutput
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.structured_output import GrammarCompiler
from tests.support.json_schemas import random_schemas

PROMPT = "Answer in JSON."
NUM_BLOCKS = 128


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def engine(request: pytest.FixtureRequest, tiny_model_dirs) -> LLMEngine:
    return LLMEngine(tiny_model_dirs[request.param], block_size=4, num_blocks=NUM_BLOCKS)


def drain(engine: LLMEngine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        engine.kv_cache.check()
    return outputs


def schema_params(schema: dict, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 400)
    return SamplingParams(structured_output=StructuredOutput(json.dumps(schema)), **kwargs)


def text_of(outputs: list) -> str:
    return "".join(o.new_text for o in outputs)


def test_random_schemas_give_valid_json_in_one_batch(engine: LLMEngine) -> None:
    schemas = random_schemas(8, seed=7)
    for i, schema in enumerate(schemas):
        engine.add_request(f"r{i}", PROMPT, schema_params(schema, seed=i))
    engine.add_request("free", PROMPT, SamplingParams(max_tokens=20, seed=1))
    outputs = drain(engine)
    for i, schema in enumerate(schemas):
        assert outputs[f"r{i}"][-1].finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(outputs[f"r{i}"])), schema)
    assert outputs["free"][-1].finished
    assert engine.kv_cache.num_available_blocks == NUM_BLOCKS


def test_greedy_and_ignore_eos_still_end_where_the_grammar_ends(engine: LLMEngine) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    engine.add_request("g", PROMPT, schema_params(schema, temperature=0))
    engine.add_request("i", PROMPT, schema_params(schema, ignore_eos=True, seed=3))
    outputs = drain(engine)
    for request_id in ("g", "i"):
        assert outputs[request_id][-1].finish_reason == "stop"
        assert json.loads(text_of(outputs[request_id])).keys() == {"ok"}


def test_max_tokens_cuts_the_json_with_finish_reason_length(engine: LLMEngine) -> None:
    schema = {"type": "string", "minLength": 50, "maxLength": 60}
    engine.add_request("r", PROMPT, schema_params(schema, max_tokens=5, seed=0))
    last = drain(engine)["r"][-1]
    assert (last.finish_reason, last.completion_tokens) == ("length", 5)


def test_a_schema_the_library_refuses_is_an_invalid_request_that_holds_nothing(
    engine: LLMEngine,
) -> None:
    bad = StructuredOutput('{"type": "nope"}', param="response_format")
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("r", PROMPT, SamplingParams(structured_output=bad))
    assert err.value.param == "response_format"
    assert not engine.has_unfinished_requests()
    not_json = StructuredOutput("{not json", param="tools")
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("r", PROMPT, SamplingParams(structured_output=not_json))
    assert err.value.param == "tools"
    assert engine.kv_cache.num_available_blocks == NUM_BLOCKS


def test_min_tokens_is_refused_with_structured_output() -> None:
    with pytest.raises(InvalidParameterError) as err:
        schema_params({"type": "object"}, min_tokens=2)
    assert err.value.param == "min_tokens"


def test_a_grammar_failing_mid_generation_ends_its_request_alone(engine: LLMEngine) -> None:
    """The library's own lexer limit, set low, makes its mask fail after the first token:
    the request ends with "error", its neighbours finish, every block comes back."""
    engine.grammars = GrammarCompiler(
        engine.tokenizer,
        engine.runner.config.vocab_size,
        engine.eos_token_ids,
        limits=llguidance.LLParserLimits(step_lexer_fuel=1),
    )
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}}
    engine.add_request("bad", PROMPT, schema_params(schema, seed=0))
    engine.add_request("free", PROMPT, SamplingParams(max_tokens=8, seed=0))
    outputs = drain(engine)
    assert outputs["bad"][-1].finish_reason == "error"
    assert outputs["free"][-1].finish_reason in ("stop", "length")
    assert engine.kv_cache.num_available_blocks == NUM_BLOCKS
