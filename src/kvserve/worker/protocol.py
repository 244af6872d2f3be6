"""Request bodies of the OpenAI endpoints, validated strictly.

Strict mode means a string is not silently read as a number and ``true`` is not a
token id: a wrong type is a 400 naming the parameter, as OpenAI does. Bounds are checked
here, before the request reaches the engine thread, so that no fuzzed value can reach
torch.

A field the worker does not honour is never ignored: an unknown field is a 400 naming it
(``extra="forbid"``), and a known OpenAI field the worker cannot serve, or can serve only
at its neutral value (a penalty of 0, an empty ``logit_bias``), is a 400 naming it when
set otherwise (:meth:`SamplingRequest.unhonoured`). A client asking for JSON or a
tool call thus learns at once that it will not get one, instead of reading free text.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.core.sampling_params import MAX_LOGPROBS

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

# OpenAI fields this worker does not serve yet: set to anything but null, a 400 names them.
NOT_SERVED = (
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False


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

    def unhonoured(self) -> Refusal | None:
        """The first field set to a value the worker would not honour, and why."""
        for name in NOT_SERVED:
            if getattr(self, name, None) is not None:
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
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None

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


class ChatMessage(BaseModel):
    """One message; a field the worker does not use is a 400 naming it, except those an
    SDK sends back null when a client replays an assistant message."""

    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None  # handed to the chat template, which may render it
    refusal: None = None
    tool_calls: None = None
    function_call: None = None
    audio: None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict[str, str]:
        """What the chat template sees of this message."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_MAX_INT32)
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` is the current name; ``max_tokens`` the legacy one."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        """Alternatives per token when logprobs are asked for (None: not asked)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unhonoured(self) -> Refusal | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.max_tokens == 0:
            return "max_tokens", "max_tokens must be at least 1"
        return super().unhonoured()
