"""What a request's output must match, as the engine is told it (no torch, no grammar
library): the HTTP layer turns ``response_format`` and forced tool calls into one of these,
the engine compiles it into a per-sequence grammar matcher."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """The output must be one JSON value that validates against ``json_schema``.

    ``json_schema`` is the schema as JSON text (``{"type": "object"}`` for any object).
    ``param`` names the request field it came from (``response_format``, ``tools``,
    ``tool_choice``), so that a schema the grammar library refuses is reported as a 400
    on the field the client wrote.
    """

    json_schema: str
    param: str = "response_format"
