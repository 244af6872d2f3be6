"""When a request stops: token-level rules and stop strings.

Stop strings are searched in detokenized text, but only where a match can newly
appear, so a long generation is not rescanned every step. Text that might still turn
into a stop string is held back from streaming, so that the deltas a client receives
add up to exactly the final text.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvserve.core.request import Request


def token_finish_reason(request: Request, eos_token_ids: Collection[int]) -> str | None:
    """Why the request stops after its latest token (``"stop"`` / ``"length"``), if it does.

    Below ``min_tokens`` a stop token is not a stop (the sampler also masks them).
    """
    params = request.params
    if request.num_output_tokens >= params.min_tokens:
        last = request.token_ids[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
            return "stop"
    if request.num_output_tokens >= request.max_tokens:
        return "length"
    return None


def find_stop_string(text: str, stops: Sequence[str], num_new_chars: int) -> int | None:
    """Start of the earliest stop string that overlaps the last ``num_new_chars`` of text."""
    if not stops or num_new_chars <= 0:
        return None
    old_end = len(text) - num_new_chars
    starts = [i for s in stops if (i := text.find(s, max(0, old_end - len(s) + 1))) >= 0]
    return min(starts) if starts else None


def stop_holdback(stops: Sequence[str]) -> int:
    """Characters to keep unstreamed: the most of a stop string that can be pending."""
    return max((len(s) for s in stops), default=1) - 1
