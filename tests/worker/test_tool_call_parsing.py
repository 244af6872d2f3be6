"""tool_choice "auto": the model's own tool-call format read back into calls, per family of
chat template (Qwen/Hermes ``<tool_call>`` blocks, Llama's bare JSON object); text that is
no call stays content. And the plan each tool_choice makes."""

from __future__ import annotations

import json

import pytest

from kvserve.engine.tiny_model import make_tiny_model
from kvserve.model_folder.tokenizer import Tokenizer
from kvserve.worker.errors import APIError
from kvserve.worker.protocol import NamedToolChoice, ToolSpec
from kvserve.worker.tool_call_stream import ToolCallStream
from kvserve.worker.tool_calls import (
    ParsedOutput,
    ToolCall,
    ToolPlan,
    parse_hermes,
    parse_llama_json,
    plan_tools,
)

TOOLS = [
    ToolSpec.model_validate(
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ),
    ToolSpec.model_validate({"type": "function", "function": {"name": "add"}}),
]
NAMED_ADD = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})


def test_hermes_blocks_become_calls_and_the_rest_is_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call><tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    parsed = parse_hermes(text)
    assert parsed.content == "Let me check."
    assert parsed.calls == [
        ToolCall("get_weather", json.dumps({"city": "Oslo"})),
        ToolCall("add", json.dumps({"a": 1, "b": 2})),
    ]


@pytest.mark.parametrize(
    "text",
    ["plain text", "<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'],
)
def test_hermes_text_without_a_valid_call_is_content(text: str) -> None:
    assert parse_hermes(text) == ParsedOutput(text, [])


def test_llama_json_object_with_arguments_or_parameters_is_a_call() -> None:
    for key in ("arguments", "parameters"):
        parsed = parse_llama_json(f' {{"name": "add", "{key}": {{"a": 1}}}}\n')
        assert parsed == ParsedOutput(None, [ToolCall("add", '{"a": 1}')])
    parsed = parse_llama_json('<|python_tag|>{"name": "add", "parameters": {}}')
    assert parsed.calls == [ToolCall("add", "{}")]
    assert parse_llama_json("The answer is 3.") == ParsedOutput("The answer is 3.", [])


@pytest.mark.parametrize(("arch", "parser"), [("llama", parse_llama_json), ("qwen2", parse_hermes)])
def test_auto_picks_the_parser_of_the_model_family(tmp_path, arch, parser) -> None:
    template = Tokenizer(make_tiny_model(tmp_path, arch)).chat_template
    plan = plan_tools(TOOLS, "auto", True, template)
    assert plan is not None and plan.structured is None
    assert plan.parse is parser
    two = (
        '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    )
    single = plan_tools(TOOLS, "auto", False, template)
    assert single is not None
    if parser is parse_hermes:  # parallel_tool_calls false: the first call only
        assert [c.name for c in single.parse(two).calls] == ["add"]


def test_each_tool_choice_plans_its_constraint() -> None:
    assert plan_tools(TOOLS, "none", True, None) is None
    assert plan_tools(None, None, True, None) is None
    named = plan_tools(TOOLS, NAMED_ADD, True, None)
    assert named is not None and named.structured is not None
    # a function without parameters takes an empty object
    assert json.loads(named.structured.json_schema)["additionalProperties"] is False
    assert named.parse('{"a": 1}').calls == [ToolCall("add", '{"a": 1}')]
    assert named.parse('{"a": ') == ParsedOutput('{"a": ', [])  # cut short: text
    required = plan_tools(TOOLS, "required", False, None)
    assert required is not None and required.structured is not None
    schema = json.loads(required.structured.json_schema)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    calls = required.parse('[{"name": "add", "arguments": {}}]').calls
    assert calls == [ToolCall("add", "{}")]
    assert required.parse('[{"name": "add"').content == '[{"name": "add"'  # cut short
    with pytest.raises(APIError) as err:
        plan_tools(TOOLS, "auto", True, None)  # no template: no format to parse
    assert err.value.param == "tool_choice"


def stream_of(plan: ToolPlan | None, pieces: list[str]) -> tuple[list[str], ParsedOutput]:
    """What a stream sends as content piece by piece, and what it parses at the end."""
    assert plan is not None
    stream = ToolCallStream(plan)
    return [stream.push(piece) for piece in pieces], stream.finish()


def test_auto_stream_sends_content_at_once_and_holds_from_a_split_marker(tmp_path) -> None:
    template = Tokenizer(make_tiny_model(tmp_path, "qwen2")).chat_template
    plan = plan_tools(TOOLS, "auto", True, template)
    pieces = ["Let me ", "check. <tool", '_call>{"name": "add", ', '"arguments": {}}</tool_call>']
    sent, parsed = stream_of(plan, pieces)
    assert sent == ["Let me ", "check. ", "", ""]  # "<tool" waits: it may begin a call
    assert parsed == ParsedOutput(None, [ToolCall("add", "{}")])
    sent, parsed = stream_of(plan, ["a <to", "y> b"])  # not a marker after all
    assert sent == ["a ", "<toy> b"] and parsed == ParsedOutput("", [])


def test_llama_stream_holds_only_an_answer_that_opens_like_a_call(tmp_path) -> None:
    template = Tokenizer(make_tiny_model(tmp_path, "llama")).chat_template
    plan = plan_tools(TOOLS, "auto", True, template)
    sent, parsed = stream_of(plan, ["The answer", " is {3}."])
    assert sent == ["The answer", " is {3}."] and parsed.calls == []
    sent, parsed = stream_of(plan, [" ", '{"name": "add",', ' "parameters": {"a": 1}}'])
    assert sent == ["", "", ""]
    assert parsed == ParsedOutput(None, [ToolCall("add", '{"a": 1}')])


def test_a_forced_call_is_held_whole() -> None:
    sent, parsed = stream_of(plan_tools(TOOLS, NAMED_ADD, True, None), ['{"a"', ": 1}"])
    assert sent == ["", ""] and parsed.calls == [ToolCall("add", '{"a": 1}')]
