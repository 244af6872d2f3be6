"""What the engine hands back: per-step deltas for streaming, whole results for ``LLM``."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.logprobs import TokenLogprob


@dataclass(slots=True)
class RequestOutput:
    """The part of one request produced by one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # detokenized delta (stop strings already cut)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from cache (any tier)
    completion_tokens: int
    # Requested with SamplingParams.logprobs: one per new token.
    logprobs: list[TokenLogprob] | None = None
    # Requested with SamplingParams.prompt_logprobs: one per prompt token (None for the
    # first), on the request's first output only.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs, for echo


@dataclass(slots=True)
class GenerationResult:
    """One prompt's complete result from :meth:`kvserve.LLM.generate`.

    A request the engine refused has ``finish_reason == "error"`` and ``error`` set;
    the other prompts of the same call are served normally.
    """

    prompt: str | list[int]
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
