"""``tools`` and ``tool_choice``: what the output is constrained to, and how it is read
back into OpenAI's ``tool_calls``.

- ``"required"``: the output is constrained to a JSON array of one or more calls
  ``{"name": <a tool>, "arguments": <its parameters' schema>}`` (one at most when
  ``parallel_tool_calls`` is false).
- a named function: the output is constrained to that function's arguments object.
- ``"auto"`` (the default when tools are given): nothing is constrained; the output is
  parsed in the tool-call format of the model's chat template: ``<tool_call>{...}
  </tool_call>`` (Qwen / Hermes templates) or a bare ``{"name", "arguments" |
  "parameters"}`` object (Llama 3 templates). A template with neither is refused with a
  400: the calls could not be recognised, and ignoring the tools silently is worse.
- ``"none"``: nothing is constrained or parsed; the template still renders the tools.

The grammar makes forced calls valid JSON for the schema even from a random-weight model;
an output cut by ``max_tokens`` cannot be parsed and comes back as text with
``finish_reason: "length"``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.core.structured_output import StructuredOutput
from kvserve.model_folder.chat_template import ChatTemplateError, select_template
from kvserve.worker.errors import invalid_request
from kvserve.worker.protocol import NamedToolChoice, ToolSpec

_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class CallMarkers:
    """Where a template's tool call may begin in free text: at any of ``starts``, anywhere
    in the answer, or (``leading``) only at its start (after blanks)."""

    starts: tuple[str, ...]
    leading: bool


HERMES_MARKERS = CallMarkers(("<tool_call>",), leading=False)
LLAMA_MARKERS = CallMarkers(("{", "<|python_tag|>"), leading=True)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's tools shape generation (``structured``) and its answer
    (``parse``); ``markers``: where calls may start in a free answer (auto), None when
    the whole answer is calls (forced)."""

    structured: StructuredOutput | None
    parse: Callable[[str], ParsedOutput]
    markers: CallMarkers | None = None


def plan_tools(
    tools: Sequence[ToolSpec] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool,
    chat_template: str | list[dict[str, str]] | None,
) -> ToolPlan | None:
    """The plan for a chat request's tool fields, None when they change nothing; a 400
    naming the field for anything malformed or unsupported."""
    functions = _functions(tools or [])
    choice = _choice(tool_choice, functions)
    if choice == "none":
        return None
    if choice == "auto":
        parse, markers = _auto_format(chat_template)
        return ToolPlan(None, parse if parallel_tool_calls else _first_call(parse), markers)
    if choice == "required":
        return ToolPlan(_required_schema(functions, parallel_tool_calls), _parse_required)
    schema = StructuredOutput(json.dumps(functions[choice]), param="tools")
    return ToolPlan(schema, _named_parser(choice))


def finish_reason(parsed: ParsedOutput, reason: str | None) -> str | None:
    """OpenAI's ``"tool_calls"`` for an answer that calls tools and ended by itself."""
    return "tool_calls" if parsed.calls and reason == "stop" else reason


def message(parsed: ParsedOutput) -> dict[str, Any]:
    """The assistant message of a non-streamed choice."""
    body: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        body["tool_calls"] = [_wire(call) for call in parsed.calls]
    return body


def delta(parsed: ParsedOutput) -> dict[str, Any]:
    """The delta that carries a streamed answer's held content and its calls, whole."""
    body: dict[str, Any] = {}
    if parsed.content:
        body["content"] = parsed.content
    if parsed.calls:
        body["tool_calls"] = [{"index": i, **_wire(call)} for i, call in enumerate(parsed.calls)]
    return body


def _wire(call: ToolCall) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


# -- request side ----------------------------------------------------------------------


def _functions(tools: Sequence[ToolSpec]) -> dict[str, dict[str, Any]]:
    """Each tool's name → its parameters' schema (an argument-less one if none given)."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.function
        if function.name in functions:
            raise invalid_request(
                f"tools[{i}]: function {function.name!r} is listed twice", param="tools"
            )
        functions[function.name] = (
            function.parameters if function.parameters is not None else _NO_ARGUMENTS
        )
    return functions


def _choice(tool_choice: str | NamedToolChoice | None, functions: dict[str, Any]) -> str:
    """ "none", "auto", "required", or the name of the function to call."""
    if tool_choice is None:
        return "auto" if functions else "none"
    if isinstance(tool_choice, str):
        if tool_choice == "required" and not functions:
            raise invalid_request("tool_choice 'required' needs tools", param="tool_choice")
        return tool_choice if functions else "none"
    name = tool_choice.function.name
    if name not in functions:
        raise invalid_request(
            f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    return name


def _required_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> StructuredOutput:
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, parameters in functions.items()
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput(json.dumps(schema), param="tools")


# -- answer side -----------------------------------------------------------------------


def _first_call(parse: Callable[[str], ParsedOutput]) -> Callable[[str], ParsedOutput]:
    """``parallel_tool_calls: false`` in auto mode: calls after the first are dropped."""

    def first(text: str) -> ParsedOutput:
        parsed = parse(text)
        return ParsedOutput(parsed.content, parsed.calls[:1])

    return first


def _named_parser(name: str) -> Callable[[str], ParsedOutput]:
    """The whole answer is the function's arguments (unless cut short: then text)."""

    def parse(text: str) -> ParsedOutput:
        try:
            json.loads(text)
        except ValueError:
            return ParsedOutput(text, [])
        return ParsedOutput(None, [ToolCall(name, text)])

    return parse


def _parse_required(text: str) -> ParsedOutput:
    try:
        calls = json.loads(text)
        return ParsedOutput(None, [ToolCall(c["name"], json.dumps(c["arguments"])) for c in calls])
    except (ValueError, TypeError, KeyError):  # cut short by max_tokens or a stop string
        return ParsedOutput(text, [])


def _auto_format(
    chat_template: str | list[dict[str, str]] | None,
) -> tuple[Callable[[str], ParsedOutput], CallMarkers]:
    try:
        template = select_template(chat_template, has_tools=True)
    except ChatTemplateError:
        template = None
    if template and "<tool_call>" in template:
        return parse_hermes, HERMES_MARKERS
    if template and "tools" in template and "<|start_header_id|>" in template:
        return parse_llama_json, LLAMA_MARKERS
    raise invalid_request(
        "tool_choice 'auto' is not supported for this model: its chat template has no "
        "tool-call format the server can parse; use 'required', a named function, or 'none'",
        param="tool_choice",
    )


def parse_hermes(text: str) -> ParsedOutput:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the text
    around them is the content."""
    calls = [call for block in _HERMES_CALL.findall(text) if (call := _call(block))]
    if not calls:
        return ParsedOutput(text, [])
    content = _HERMES_CALL.sub("", text).strip()
    return ParsedOutput(content or None, calls)


def parse_llama_json(text: str) -> ParsedOutput:
    """A whole answer that is one ``{"name": ..., "arguments" | "parameters": {...}}``."""
    call = _call(text.strip().removeprefix("<|python_tag|>"))
    return ParsedOutput(None, [call]) if call else ParsedOutput(text, [])


def _call(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments))
