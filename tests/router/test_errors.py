"""The router's OpenAI error bodies."""

from __future__ import annotations

import orjson

from kvserve.router.errors import openai_error


def test_an_error_after_the_workers_headers_is_json_whatever_they_said() -> None:
    """A non-streamed answer's headers (its content type among them) can arrive before its
    body fails: the error built from those headers must still be a JSON error."""
    headers = {"Content-Type": "text/event-stream", "x-kvserve-worker": "w1"}
    response = openai_error(502, "worker unreachable", error_type="upstream_error", headers=headers)
    assert response.status == 502
    assert response.content_type == "application/json"
    assert response.headers["x-kvserve-worker"] == "w1"
    assert response.body is not None
    assert orjson.loads(bytes(response.body))["error"]["type"] == "upstream_error"  # type: ignore[arg-type]
