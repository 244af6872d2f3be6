"""The two types every workload source produces and the load generator consumes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

Prompt = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One workload item: a ``/v1/completions`` prompt, or a chat.

    A chat's user turns after the first are sent only once the previous answer has
    arrived, and carry the real answers in their history: that is what makes a second
    turn share the first turn's KV cache on a real server.
    """

    arrival_s: float  # offset from the start of the trace; 0 for untimed sources
    max_tokens: int
    prompt: Prompt | None = None  # completions: text or token ids
    user_turns: tuple[str, ...] = ()  # chat
    system: str | None = None  # chat only

    def __post_init__(self) -> None:
        if (self.prompt is None) == (not self.user_turns):
            raise ValueError("a RequestSpec is either a completion prompt or a chat")
        if self.system is not None and not self.user_turns:
            raise ValueError("a system prompt needs a chat")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def is_chat(self) -> bool:
        return bool(self.user_turns)

    @property
    def num_requests(self) -> int:
        """HTTP requests this item makes (one per chat turn)."""
        return len(self.user_turns) or 1


@dataclass(frozen=True, slots=True)
class Workload:
    """A named stream of request specs.

    ``requests`` may be lazy (trace sources build each prompt as the load generator
    reaches it), so a one-hour trace with 12k-token prompts never sits in memory whole.
    ``timed`` says the arrival times come from a trace and can be replayed open-loop.
    """

    name: str
    timed: bool
    size: int
    requests: Iterable[RequestSpec]


def capped(count: int, limit: int | None) -> int:
    """How many items a generator makes when the run asks for at most ``limit``."""
    return count if limit is None else min(count, limit)


def untimed_prompts(name: str, prompts: list[Prompt], max_tokens: int) -> Workload:
    """A generator's completion prompts as a workload with no timestamps."""
    specs = [RequestSpec(arrival_s=0.0, max_tokens=max_tokens, prompt=p) for p in prompts]
    return Workload(name, timed=False, size=len(specs), requests=specs)
