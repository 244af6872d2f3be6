"""How one request is sampled and when it stops.

No torch here: the worker validates request bodies and the router reads them without
loading the engine. Validation names the offending parameter so that the HTTP layer
can answer a 400 with OpenAI's ``param`` field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.core.structured_output import StructuredOutput

_GREEDY_BELOW = 1e-5
# Alternatives returned per token: OpenAI's own bound for top_logprobs.
MAX_LOGPROBS = 20


class InvalidParameterError(ValueError):
    """A request parameter is out of range; ``param`` names it for the client."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping rules, with vLLM's names and defaults.

    ``temperature == 0`` (or below 1e-5) means greedy. ``top_k <= 0`` and ``top_p == 1``
    disable those filters. ``max_tokens=None`` lets the request run to the end of the
    model's context.
    A ``seed`` makes the request's samples reproducible whatever else is in the batch.
    ``structured_output`` constrains every sampled token to a grammar (JSON schema).

    ``logprobs=k`` returns each sampled token's log-probability and the ``k`` most likely
    alternatives (0: the sampled token's alone); ``prompt_logprobs=k`` the same for every
    prompt token but the first, which ``max_tokens=0`` then allows without generating
    (OpenAI's ``echo`` with ``max_tokens: 0``, which eval harnesses score with).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise :class:`InvalidParameterError` for the first out-of-range field.

        Called at construction and again by the engine, since the object is mutable.
        """
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < least
        ):
            raise InvalidParameterError(
                "max_tokens",
                f"max_tokens must be an integer >= {least}, got {self.max_tokens!r}"
                + ("" if least == 0 else " (0 only with prompt logprobs)"),
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidParameterError(
                    name, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        if not self.temperature >= 0:
            raise InvalidParameterError(
                "temperature", f"temperature must be >= 0, got {self.temperature!r}"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int):
            raise InvalidParameterError("top_k", f"top_k must be an integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidParameterError("seed", f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidParameterError(
                "min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if self.structured_output is not None and self.min_tokens > 0:
            # The grammar alone decides where a structured output may end.
            raise InvalidParameterError(
                "min_tokens", "min_tokens cannot be combined with structured output"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParameterError("stop", "stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidParameterError(
                "stop_token_ids", "stop_token_ids must be non-negative integers"
            )

    @property
    def greedy(self) -> bool:
        # Dividing logits by a temperature this small overflows; its limit is argmax.
        return self.temperature < _GREEDY_BELOW
