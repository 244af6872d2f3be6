"""Request bodies of the OpenAI endpoints, validated strictly.

Strict mode means a string is not silently read as a number and ``true`` is not a
token id: a wrong type is a 400 naming the parameter, as OpenAI does. Bounds are checked
here, before the request reaches the engine thread, so that no fuzzed value can reach
torch.

A field the worker does not honour is never ignored: an unknown field is a 400 naming it
(``extra="forbid"``), and a known OpenAI field the worker cannot serve, or can serve only
at its neutral value (a penalty of 0, an empty ``logit_bias``), is a 400 naming it when
set otherwise (:meth:`SamplingRequest.unhonoured`). A client asking for something the
worker would not do (a penalty, legacy ``functions``) thus learns it at once, instead of
reading an answer that silently ignored it.

Chat messages are typed by role (a discriminated union), so the OpenAPI schema says what
each role may carry: an assistant's ``tool_calls`` and a tool result's ``tool_call_id``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.core.sampling_params import MAX_LOGPROBS
from kvserve.model_folder.chat_request import template_message, template_tools

_MAX_INT32 = 2**31 - 1
_MAX_STOP_STRINGS = 16
# Choices per request (n, best_of) and prompts per request: each is a sequence in the
# engine, so the bound keeps one request from filling the batch on its own.
MAX_CHOICES = 128
MAX_PROMPTS = 256
MAX_CHOICES_PER_REQUEST = 256  # all prompts' choices together

TokenId = Annotated[int, Field(ge=0, le=_MAX_INT32)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PromptText = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=1024)]
StopStrings = Annotated[list[StopString], Field(max_length=_MAX_STOP_STRINGS)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Refusal = tuple[str, str]  # (field, why)

# OpenAI fields this worker does not serve: set to anything but null, a 400 names them.
# Legacy function calling (``tools`` replaced it) on both routes; tools on completions.
_LEGACY_FUNCTIONS = ("functions", "function_call")
_COMPLETION_NOT_SERVED = ("tools", "tool_choice", "parallel_tool_calls", *_LEGACY_FUNCTIONS)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False


class JSONSchemaSpec(BaseModel):
    """``response_format.json_schema``: the schema itself is checked by the grammar
    library when it is compiled (a refusal is a 400 naming ``response_format``)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=0, le=_MAX_INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=_MAX_INT32)
    min_tokens: int = Field(default=0, ge=0, le=_MAX_INT32)
    stop: StopString | StopStrings | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormatRequest | None = None
    # Served only at their neutral values (see unhonoured).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    # Fields declared (so that a 400 names them as unsupported, not unknown) but not served.
    not_served: ClassVar[tuple[str, ...]] = ()

    def unhonoured(self) -> Refusal | None:
        """The first field set to a value the worker would not honour, and why."""
        for name in self.not_served:
            if getattr(self, name) is not None:
                return name, f"{name} is not supported by this server"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                return name, f"{name} is not supported by this server (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported by this server (only {})"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None


class CompletionRequest(SamplingRequest):
    """``prompt`` is a string, token ids, or a list of either: one choice per prompt."""

    prompt: (
        PromptText
        | TokenIds
        | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    echo: bool = False
    logprobs: NumLogprobs | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    suffix: None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None

    not_served = _COMPLETION_NOT_SERVED

    def samples_per_prompt(self) -> int:
        """Choices generated per prompt: ``best_of`` of them, the ``n`` best returned."""
        return self.best_of if self.best_of is not None else self.n

    def prompts(self) -> list[str] | list[list[int]]:
        """Every prompt of the request, in order."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [prompt]  # a list of token ids is one prompt
        return prompt  # a list of prompts

    def unhonoured(self) -> Refusal | None:
        if len(self.prompts()) * self.samples_per_prompt() > MAX_CHOICES_PER_REQUEST:
            field = "n" if self.best_of is None else "best_of"
            return field, f"prompts x {field} must be at most {MAX_CHOICES_PER_REQUEST}"
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", "best_of must be at least n"
        if self.best_of is not None and self.best_of > self.n and self.stream:
            return "best_of", "best_of > n cannot be streamed: the best are known at the end"
        if self.max_tokens == 0 and not self.echo:
            # 0 only scores the prompt, which only echo returns
            return "max_tokens", "max_tokens may be 0 only with echo"
        return super().unhonoured()


class TextContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str


Content = str | list[TextContentPart]


class _Message(BaseModel):
    """A field the worker does not use is a 400 naming it (each role's model lists what
    it may carry)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    content: Content | None
    name: str | None = None  # handed to the chat template, which may render it


class InstructionMessage(_Message):
    role: Literal["system", "developer", "user"]
    content: Content


class FunctionCallRecord(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str
    arguments: str  # JSON text, as the server sent it


class ToolCallRecord(BaseModel):
    """A call an earlier assistant turn made, sent back with the conversation."""

    model_config = ConfigDict(strict=True, extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallRecord


class AssistantMessage(_Message):
    """An earlier answer. ``refusal``, ``function_call`` and ``audio`` are accepted only
    null: the openai SDK sends them so when a client replays a response message."""

    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallRecord] | None = None
    refusal: None = None
    function_call: None = None
    audio: None = None

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
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_MAX_INT32)
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: Any = None
    function_call: Any = None

    not_served = _LEGACY_FUNCTIONS

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` is the current name; ``max_tokens`` the legacy one."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_input(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools the chat template renders, in the normal form the router
        also builds from the raw body (:mod:`kvserve.model_folder.chat_request`)."""
        messages = [template_message(m.model_dump(exclude_none=True)) for m in self.messages]
        tools = template_tools([t.model_dump(exclude_none=True) for t in self.tools or ()])
        return messages, tools

    def num_logprobs(self) -> int | None:
        """Alternatives per token when logprobs are asked for (None: not asked)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unhonoured(self) -> Refusal | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.max_tokens == 0:
            return "max_tokens", "max_tokens must be at least 1"
        return super().unhonoured()
