"""What a server (worker or router) puts up with from one client, and the raw answers it
gives when a client goes past it.

A server on an open port meets clients that send half a request and stall, drip a body
one byte at a time, open thousands of connections, or send megabytes of headers. Each
costs a server memory or a slot while doing nothing, so each is bounded: headers must
arrive within ``header_timeout_s`` (408 and closed), a body within ``body_timeout_s``
(408), headers may total ``max_header_bytes`` (431), and at most ``max_connections``
are served at once (503 beyond). The defaults are generous for honest clients: nginx's
header timeout is 60 s and its header buffers 32 KiB.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClientLimits:
    header_timeout_s: float = 30.0  # from the connection's or the request's first byte
    body_timeout_s: float = 60.0  # from the end of the headers to the end of the body
    max_header_bytes: int = 32 * 1024  # request line and headers together
    max_connections: int = 4096  # open at once; the next request is answered 503

    def __post_init__(self) -> None:
        if min(self.header_timeout_s, self.body_timeout_s) <= 0:
            raise ValueError("header and body timeouts must be positive")
        if self.max_header_bytes < 1024 or self.max_connections < 1:
            raise ValueError("max header bytes must be at least 1024, max connections 1+")


_REASONS = {
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def raw_error_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with OpenAI's error body that closes the connection, for
    refusals made below the HTTP framework (no request object exists yet)."""
    error_type = "invalid_request_error" if status < 500 else "service_unavailable"
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body
