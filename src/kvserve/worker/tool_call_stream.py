"""A streamed answer that may call tools: content goes out as it comes, calls whole at the end.

With ``tool_choice: "auto"`` the model writes free text in which a call may begin at one
of its template's markers (``<tool_call>``, or a leading ``{`` for Llama). Text that
cannot be part of a call streams at once; from the first marker on (or a possible
beginning of one, split across tokens), the text is held and parsed when the answer
ends, into the last delta: whatever content it held and the calls. A forced call (the
whole answer is calls) is held from the start.
"""

from __future__ import annotations

from kvserve.worker.tool_calls import CallMarkers, ParsedOutput, ToolPlan


class ToolCallStream:
    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._text = ""
        self._sent = 0  # characters of ``_text`` already streamed as content
        self._holding = plan.markers is None

    def push(self, text: str) -> str:
        """Adds the answer's next text; returns the content that can be streamed now."""
        self._text += text
        if self._holding:
            return ""
        assert self._plan.markers is not None
        start, safe = _call_start(self._text, self._plan.markers)
        if start is not None:
            self._holding = True
        content = self._text[self._sent : safe]
        self._sent = max(self._sent, safe)
        return content

    def finish(self) -> ParsedOutput:
        """The held part of the answer, parsed: its content and its calls."""
        return self._plan.parse(self._text[self._sent :])


def _call_start(text: str, markers: CallMarkers) -> tuple[int | None, int]:
    """Where a call begins in ``text`` (None: nowhere yet), and how far the text is
    content for sure."""
    if markers.leading:
        body = text.lstrip()
        offset = len(text) - len(body)
        if not body:
            return None, 0  # blanks so far: a call may still come
        if any(body.startswith(m) or m.startswith(body) for m in markers.starts):
            return offset, 0
        return None, len(text)
    found = [i for m in markers.starts if (i := text.find(m)) >= 0]
    if found:
        return min(found), min(found)
    return None, len(text) - _partial_marker(text, markers.starts)


def _partial_marker(text: str, starts: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins a marker (held back: the
    marker may be completed by the next token)."""
    longest = 0
    for marker in starts:
        for length in range(1, min(len(marker), len(text) + 1)):
            if marker.startswith(text[-length:]):
                longest = max(longest, length)
    return longest
