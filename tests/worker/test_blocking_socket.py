"""A transfer's blocking socket: work runs on its own thread and reports to the loop; closing
wakes a thread blocked in the socket and closes the socket only once that thread is done."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvserve.worker.blocking_socket import BlockingSocket


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Both ends of a loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    return ours, theirs


async def test_work_runs_on_a_thread_and_its_result_or_exception_reaches_the_loop() -> None:
    ours, theirs = tcp_pair()
    conn = BlockingSocket(ours)
    try:
        theirs.sendall(b"ping")
        assert await conn.run(lambda sock: sock.recv(4), "test") == b"ping"

        def fail(sock: socket.socket) -> None:
            raise ValueError("from the thread")

        with pytest.raises(ValueError, match="from the thread"):
            await conn.run(fail, "test")
    finally:
        conn.close()
        theirs.close()
    assert ours.fileno() == -1  # no thread was using it: closed at once


async def test_close_wakes_a_blocked_thread_then_closes_the_socket() -> None:
    ours, theirs = tcp_pair()
    conn = BlockingSocket(ours)
    receiving = conn.run(lambda sock: sock.recv(1), "test")
    await asyncio.sleep(0)  # let the thread block in recv (a wrong order only shortens it)
    conn.close()
    assert await asyncio.wait_for(receiving, 10) == b""  # woken: the socket was shut down
    deadline = asyncio.get_running_loop().time() + 10
    while ours.fileno() != -1:  # the thread closes it on its way out
        assert asyncio.get_running_loop().time() < deadline, "the socket was never closed"
        await asyncio.sleep(0.01)
    assert theirs.recv(1) == b""  # the peer sees the connection end
    theirs.close()
    with pytest.raises(ConnectionAbortedError):
        conn.run(lambda sock: None, "test")


async def test_a_cancelled_wait_leaves_the_thread_to_finish_quietly() -> None:
    ours, theirs = tcp_pair()
    conn = BlockingSocket(ours)
    receiving = conn.run(lambda sock: sock.recv(1), "test")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(receiving, 0.05)
    assert receiving.cancelled()
    conn.close()
    assert theirs.recv(1) == b""
    theirs.close()
