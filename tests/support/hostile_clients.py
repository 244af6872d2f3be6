"""Clients that misbehave on purpose, on raw sockets: half a request then silence, a body
that never ends, headers too large. For the servers' client-limit tests."""

from __future__ import annotations

import socket
import time

HALF_REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def stalled(url: str, sent: bytes = HALF_REQUEST) -> socket.socket:
    """A connection that sent ``sent`` and then nothing more."""
    sock = connect(url)
    sock.sendall(sent)
    return sock


def answer(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sends before it closes the connection (b"": closed silently);
    fails if it is still open after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    received = b""
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"connection still open after {timeout_s}s: {received!r}"
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def body_never_ends(url: str, path: str, headers: str = "") -> socket.socket:
    """A POST that declares 1000 bytes of body and sends 10."""
    sock = connect(url)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}{headers}Content-Length: 1000\r\n\r\n".encode() + b'{"model": ')
    return sock


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])
