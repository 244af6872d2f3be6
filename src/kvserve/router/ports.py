"""Ports for servers this machine starts: drawn below the OS's ephemeral range.

A port that ``bind(("", 0))`` hands out comes from the ephemeral range, the same range every
outgoing connection and every other ``bind(0)`` draws from. A server that binds it later
(vLLM takes a minute or two to start on a loaded box) can find it taken by then: a health
poll's client socket or another server's internal socket. Below that range only an explicit
bind takes a port, so a port checked free here stays free until its server binds it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # above the usual fixed service ports (redis 6379, 8000, 8080, ...)
_draw = random.SystemRandom()  # not the global generator: tests seed that (hypothesis)
_handed_out: set[int] = set()  # this process never hands a port out twice


def _ephemeral_start() -> int | None:
    """The first port of the OS's ephemeral range, or None where it cannot be read."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (e.g. another server holds it), or None."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
        try:
            sock.bind((host, port))
        except OSError as error:
            return error.strerror or str(error)
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, below the ephemeral range where the OS says where that
    is (else one the OS picks)."""
    start = _ephemeral_start()
    if start is not None and start > _LOWEST + 1_000:
        for _ in range(200):
            port = _draw.randrange(_LOWEST, start)
            if port not in _handed_out and port_taken(host, port) is None:
                _handed_out.add(port)
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        picked: int = sock.getsockname()[1]
        return picked
