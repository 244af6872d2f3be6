"""PD KV transfer throughput on this machine: built-in TCP vs Mooncake TCP vs memcpy.

The same bytes (``--megabytes`` of KV, sent as runs of ``--run-megabytes``, as a prefill
worker sends the runs its steps complete) cross from one process to another three ways,
side by side in one run:

- **kvserve TCP**: the built-in transfer's path: ``pd_wire`` frames written with their
  payload on an asyncio stream, read with ``read_frame`` (stream buffer
  ``READ_LIMIT_BYTES``) and turned into owned blocks (``kv_block_io.from_bytes``'s copy)
  on the receiving side, as ``TCPKVReceiver`` does;
- **Mooncake TCP**: the Mooncake Transfer Engine (P2P handshake, ``tcp`` protocol)
  writing each run into the receiver's registered buffer (``transfer_sync_write``), as
  ``MooncakeKVSender`` does, the receiver copying each run out as ``MooncakeKVReceiver``
  does; the runs' frames on the control connection are left out (a few bytes each);
- **raw socket**: the same bytes through a blocking loopback socket, ``sendall`` on one
  side and ``recv_into`` a preallocated tensor on the other: what any TCP path here can
  reach at best (the kernel copies each byte in and out);
- **memcpy**: one process copying the same runs between two tensors (the ceiling).

Run: ``python benchmarks/kv_transfer_rate.py [--megabytes 256] [--run-megabytes 4]
[--rounds 3]``. Prints GB/s (median of the rounds) and each ratio to memcpy.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvserve.worker.pd_wire import frame_prefix, read_frame
from kvserve.worker.tcp_kv_transfer import READ_LIMIT_BYTES

MB = 1 << 20


def _runs(total: int, run: int) -> list[torch.Tensor]:
    source = torch.randint(0, 255, (total,), dtype=torch.uint8)
    return [source[i : i + run] for i in range(0, total, run)]


def memcpy_rate(total: int, run: int) -> float:
    runs, target = _runs(total, run), torch.zeros(total, dtype=torch.uint8)  # pages touched
    started = time.perf_counter()
    for i, chunk in enumerate(runs):
        target[i * run : i * run + len(chunk)].copy_(chunk)
    return total / (time.perf_counter() - started) / 1e9


# --- kvserve TCP -------------------------------------------------------------------------


def _tcp_receiver(pipe: Connection, count: int) -> None:
    async def serve() -> None:
        done = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for _ in range(count):
                _, payload = await read_frame(reader)
                torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # from_bytes' copy
            writer.write(b"k")
            await writer.drain()
            writer.close()
            done.set()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=READ_LIMIT_BYTES)
        pipe.send(server.sockets[0].getsockname()[1])
        await done.wait()
        server.close()

    while pipe.recv():  # one transfer per round
        asyncio.run(serve())


def tcp_rate(pipe: Connection, total: int, run: int) -> float:
    runs = _runs(total, run)

    async def send(port: int) -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.perf_counter()
        for chunk in runs:
            view = memoryview(chunk.numpy())
            writer.write(frame_prefix({"type": "blocks"}, len(view)))
            writer.write(view)
            await writer.drain()
        await reader.readexactly(1)
        elapsed = time.perf_counter() - started
        writer.close()
        return elapsed

    pipe.send(True)
    return total / asyncio.run(send(pipe.recv())) / 1e9


# --- raw socket --------------------------------------------------------------------------


def _socket_receiver(pipe: Connection, total: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        pipe.send(server.getsockname()[1])
        target = torch.zeros(total, dtype=torch.uint8)
        view = memoryview(target.numpy())
        while pipe.recv():
            connection, _ = server.accept()
            with connection:
                received = 0
                while received < total:
                    received += connection.recv_into(view[received:])
                connection.sendall(b"k")


def socket_rate(pipe: Connection, port: int, total: int, run: int) -> float:
    runs = _runs(total, run)
    pipe.send(True)
    with socket.create_connection(("127.0.0.1", port)) as connection:
        started = time.perf_counter()
        for chunk in runs:
            connection.sendall(memoryview(chunk.numpy()))
        connection.recv(1)
        return total / (time.perf_counter() - started) / 1e9


# --- Mooncake TCP ------------------------------------------------------------------------


def _mooncake_receiver(pipe: Connection, total: int, run: int) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buffer = torch.empty(total, dtype=torch.uint8)
    assert engine.register_memory(buffer.data_ptr(), total) == 0
    pipe.send((f"127.0.0.1:{engine.get_rpc_port()}", buffer.data_ptr()))
    while pipe.recv():
        for i in range(0, total, run):  # the sender says each run landed; copy it out
            pipe.recv()
            buffer[i : i + run].clone()
        pipe.send(True)


def mooncake_rate(
    pipe: Connection, engine: Any, peer: tuple[str, int], total: int, run: int
) -> float:
    session, address = peer
    runs = _runs(total, run)
    pipe.send(True)
    started = time.perf_counter()
    for i, chunk in enumerate(runs):
        assert engine.register_memory(chunk.data_ptr(), chunk.nbytes) == 0
        code = engine.transfer_sync_write(session, chunk.data_ptr(), address + i * run, len(chunk))
        engine.unregister_memory(chunk.data_ptr())
        assert code == 0, code
        pipe.send(i)
    pipe.recv()
    return total / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--run-megabytes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    total, run = args.megabytes * MB, args.run_megabytes * MB
    torch.set_num_threads(1)
    context = mp.get_context("spawn")
    tcp_pipe, tcp_child = context.Pipe()
    mc_pipe, mc_child = context.Pipe()
    tcp_peer = context.Process(target=_tcp_receiver, args=(tcp_child, total // run), daemon=True)
    mc_peer = context.Process(target=_mooncake_receiver, args=(mc_child, total, run), daemon=True)
    raw_pipe, raw_child = context.Pipe()
    raw_peer = context.Process(target=_socket_receiver, args=(raw_child, total), daemon=True)
    for peer in (tcp_peer, mc_peer, raw_peer):
        peer.start()
    raw_port = raw_pipe.recv()
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    peer = mc_pipe.recv()
    names = ("memcpy", "raw socket", "kvserve TCP", "Mooncake TCP")
    rates: dict[str, list[float]] = {name: [] for name in names}
    try:
        for _ in range(args.rounds):
            rates["memcpy"].append(memcpy_rate(total, run))
            rates["raw socket"].append(socket_rate(raw_pipe, raw_port, total, run))
            rates["kvserve TCP"].append(tcp_rate(tcp_pipe, total, run))
            rates["Mooncake TCP"].append(mooncake_rate(mc_pipe, engine, peer, total, run))
    finally:
        for pipe, peer in ((tcp_pipe, tcp_peer), (mc_pipe, mc_peer), (raw_pipe, raw_peer)):
            pipe.send(False)
            peer.join(5)
    memcpy = statistics.median(rates["memcpy"])
    print(f"{args.megabytes} MiB in runs of {args.run_megabytes} MiB, median of {args.rounds}")
    print(f"{'path':<14}{'GB/s':>8}{'x memcpy':>10}")
    for name, samples in rates.items():
        rate = statistics.median(samples)
        print(f"{name:<14}{rate:>8.2f}{rate / memcpy:>10.3f}")


if __name__ == "__main__":
    main()
