"""Ports for servers started here come from below the ephemeral range, never twice, and
free; a port someone listens on is reported taken."""

from __future__ import annotations

import socket
from pathlib import Path

from kvserve.router.ports import free_port, port_taken


def ephemeral_start() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_are_below_the_ephemeral_range_distinct_and_free() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(port < ephemeral_start() for port in ports)
    assert all(port_taken("127.0.0.1", port) is None for port in ports)


def test_a_port_being_listened_on_is_taken() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", free_port()))
        listener.listen()
        port = listener.getsockname()[1]
        assert port_taken("127.0.0.1", port) is not None
