"""``response_format`` → what the engine must constrain the output to.

``text`` constrains nothing; ``json_object`` asks for any JSON object; ``json_schema``
for a value that validates against the client's schema. The schema is compiled by the
engine's grammar library, which reports a schema it cannot use as a 400 on
``response_format``.
"""

from __future__ import annotations

import json

from kvserve.core.structured_output import StructuredOutput
from kvserve.worker.errors import invalid_request
from kvserve.worker.protocol import ResponseFormatRequest

_ANY_OBJECT = '{"type": "object"}'


def structured_output(response_format: ResponseFormatRequest | None) -> StructuredOutput | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput(_ANY_OBJECT)
    spec = response_format.json_schema
    if spec is None:
        raise invalid_request(
            "response_format of type 'json_schema' needs a 'json_schema' object",
            param="response_format.json_schema",
        )
    schema = spec.schema_ if spec.schema_ is not None else {}
    return StructuredOutput(json.dumps(schema))
