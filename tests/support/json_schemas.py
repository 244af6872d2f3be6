"""Random JSON schemas for the structured-output tests and the mask-cost benchmark.

Each schema mixes the features clients use: nested objects, arrays with item bounds,
enums, integers and numbers with bounds, strings with length bounds. Sizes stay small
(bounded strings, at most three items an array, depth at most three) so that a model
with random weights, steered only by the grammar, finishes within a few hundred tokens.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ("alpha", "beta", "gamma", "delta", "red", "green", "blue", "cat", "dog", "x1", "y_2")
_MAX_DEPTH = 3


def random_schema(rng: random.Random) -> dict[str, Any]:
    """An object schema (what ``response_format`` and tool parameters take)."""
    return _object(rng, depth=0)


def random_schemas(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum"]
    if depth < _MAX_DEPTH:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth + 1)
    if kind == "array":
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": _value(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 1),
        }
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 6)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        low = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(low, 2), "maximum": round(low + 5, 2)}
    if kind == "enum":
        return {"enum": rng.sample([*_WORDS, 1, 2.5, True, None], rng.randint(1, 4))}
    return {"type": "boolean"}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randint(1, 4))
    properties = {name: _value(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
