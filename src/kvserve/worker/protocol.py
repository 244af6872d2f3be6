"""Request bodies of the OpenAI endpoints, validated strictly.

Strict mode means a string is not silently read as a number and ``true`` is not a
token id: a wrong type is a 400 naming the parameter, as OpenAI does. Bounds are checked
here, before the request reaches the engine thread, so that no fuzzed value can reach
torch. Unknown fields are ignored, as the SDKs send extras the worker does not use.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_MAX_INT32 = 2**31 - 1
_MAX_STOP_STRINGS = 16

TokenId = Annotated[int, Field(ge=0, le=_MAX_INT32)]
StopString = Annotated[str, Field(min_length=1, max_length=1024)]
StopStrings = Annotated[list[StopString], Field(max_length=_MAX_STOP_STRINGS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class JSONSchemaSpec(BaseModel):
    """``response_format.json_schema``: the schema itself is checked by the grammar
    library when it is compiled (a refusal is a 400 naming ``response_format``)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=_MAX_INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=_MAX_INT32)
    min_tokens: int = Field(default=0, ge=0, le=_MAX_INT32)
    stop: StopString | StopStrings | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    n: Literal[1] = 1
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormatRequest | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None


class TextContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


Content = str | list[TextContentPart]


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    content: Content | None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class InstructionMessage(_Message):
    role: Literal["system", "developer", "user"]
    content: Content


class FunctionCallRecord(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    arguments: str  # JSON text, as the server sent it


class ToolCallRecord(BaseModel):
    """A call an earlier assistant turn made, sent back with the conversation."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallRecord


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallRecord] | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[
    InstructionMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_MAX_INT32)
    logprobs: Literal[False] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` is the current name; ``max_tokens`` the legacy one."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens
