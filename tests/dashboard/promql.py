"""The metric names a PromQL expression reads, without a PromQL parser dependency: drop
string literals, label matchers, ranges and grouping clauses, then every identifier that
is not a function, aggregation or keyword names a metric."""

from __future__ import annotations

import re

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w$.])([a-zA-Z_:][\w:]*)(\s*\()?")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"})


def metric_names(expression: str) -> set[str]:
    text = _STRINGS.sub("", expression)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {name for name, call in _IDENTIFIER.findall(text) if not call and name not in _KEYWORDS}
