"""A JSON response rendered by orjson.

Responses are built as plain dicts and encoded once with orjson: faster than validating
them through pydantic models, and exact for 64-bit block hashes.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)
