"""Free loopback ports for test servers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port that was free a moment ago (the OS picks it; reuse races are rare on loopback)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
