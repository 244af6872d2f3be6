"""PD KV transfer throughput on this machine: built-in TCP vs Mooncake TCP vs memcpy.

The same bytes (``--megabytes`` of KV, sent as runs of ``--run-megabytes``, as a prefill
worker sends the runs its steps complete) cross from one process to another three ways,
side by side in one run:

- **kvserve TCP**: the built-in transfer itself: a ``TCPKVSender`` in one process serving
  exports whose runs are all ready (``ReadyExports``: the transfer alone is timed, not the
  engine), fetched by ``TCPKVReceiver.fetch_from`` in the other (each run read straight
  into memory from its ``RunBuffers``, handed to an install that keeps nothing), timed
  from the request to the ``done`` frame (``--fresh-memory`` adds the same into fresh
  memory for every run: what ``RunBuffers`` saves; ``--unmerged`` adds a sender that
  writes one frame per run, where the real one joins queued runs into frames of up to
  ``MERGE_BYTES``, as it does for a backlog);
- **kvserve shm**: the same sender and ``fetch_from`` on the same-host path
  (``--kv-transfer-same-host shm``): the receiver takes a ``/dev/shm`` segment from its
  ``SegmentPool`` and names it, as ``TCPKVReceiver.fetch`` does (kept from round to
  round, as a decode worker keeps it; the sender keeps its mapping), the sender copies
  each run into it and sends a payload-less frame, the receiver installs from the
  segment in place, then gives it back; all of that is timed (``--fresh-segment`` adds
  the same with a new segment every round, its pages allocated and mapped anew;
  ``--first-transfer`` adds a decode worker's first transfer: a new receiver, started as
  a worker starts it (its first segment made then, untimed), whose segment the sender
  has never mapped);
- **Mooncake TCP**: the Mooncake Transfer Engine (P2P handshake, ``tcp`` protocol)
  writing each run into the receiver's registered buffer (``transfer_sync_write``), as
  ``MooncakeKVSender`` does, the receiver copying each run out as ``MooncakeKVReceiver``
  does; the runs' frames on the control connection are left out (a few bytes each);
- **raw socket**: the same bytes through a blocking loopback socket, ``sendall`` on one
  side and ``recv_into`` a preallocated tensor on the other: what any TCP path here can
  reach at best (the kernel copies each byte in and out);
- **memcpy**: one process copying the same runs from one tensor into another of the same
  size (pages touched beforehand): the reference, one copy of each byte.

Run: ``python benchmarks/kv_transfer_rate.py [--megabytes 256] [--run-megabytes 4]
[--rounds 3] [--no-mooncake] [--fresh-memory] [--unmerged] [--fresh-segment]
[--first-transfer]``. The
paths alternate round by round; prints GB/s (median of the rounds, and every round) and
each median's ratio to memcpy's.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvserve.engine.kv_block_io import KVBlockLayout
from kvserve.engine.pd_export import ExportSink
from kvserve.worker.run_buffers import RunBuffers
from kvserve.worker.shm_landing import SegmentPool, ShmLanding, host_id
from kvserve.worker.tcp_kv_transfer import (
    MERGE_BYTES,
    SEGMENT_KEEP_BYTES,
    Landing,
    PayloadLanding,
    TCPKVReceiver,
    TCPKVSender,
)

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

# A KV layout whose blocks are 256 KiB (float16); a run of R MiB is 4 R blocks.
LAYOUT = KVBlockLayout("bench", num_layers=8, block_size=16, num_kv_heads=4, head_dim=128,
                       dtype="float16")  # fmt: skip


class ReadyExports:
    """Exports whose blocks are all computed already: the sender's sink gets every run at
    once, so the transfer alone is timed."""

    def __init__(self, runs: list[torch.Tensor]) -> None:
        self._runs = runs

    async def start(
        self, export_id: str, token_ids: list[int], first_block: int, num_blocks: int,
        sink: ExportSink, cache_salt: str | None,
    ) -> None:  # fmt: skip
        first = 0
        for run in self._runs:
            sink.blocks(first, run)
            first += len(run)
        sink.done(0)

    def abort(self, export_id: str) -> None:
        pass


def _tcp_sender(pipe: Connection, total: int, run: int, merge_bytes: int) -> None:
    torch.set_num_threads(1)
    per_run = run // LAYOUT.block_nbytes
    blocks = _runs(total, total)[0].view(LAYOUT.torch_dtype).reshape(-1, *LAYOUT.block_shape)
    runs = [blocks[i : i + per_run] for i in range(0, len(blocks), per_run)]

    async def serve() -> None:
        sender = TCPKVSender(ReadyExports(runs), LAYOUT, "127.0.0.1", merge_bytes=merge_bytes)
        await sender.start()
        pipe.send(sender.port)
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)  # until told
        await sender.close()

    asyncio.run(serve())


def tcp_rate(
    port: int, total: int, receiver: TCPKVReceiver, shm: SegmentPool | None = None
) -> float:
    """The decode side's real path: ``TCPKVReceiver.fetch_from`` reading each run into
    memory from its ``RunBuffers`` (kept from round to round, as a decode worker keeps
    them; a receiver keeping none lands every run in fresh memory), handed to an install
    that keeps nothing. With ``shm``, the bytes land in a shared segment from that pool
    (given back after the transfer)."""
    num_blocks = total // LAYOUT.block_nbytes

    async def install(first_block: int, blocks: torch.Tensor) -> None:
        pass

    async def fetch() -> float:
        started = time.perf_counter()
        tokens = [1] * (num_blocks * LAYOUT.block_size + 1)
        landing: Landing = PayloadLanding(LAYOUT, receiver.buffers)
        if shm is None:
            await receiver.fetch_from(("127.0.0.1", port), tokens, 0, num_blocks, install, landing)
            return time.perf_counter() - started
        segment = await asyncio.to_thread(shm.take, total)
        payloads = PayloadLanding(LAYOUT, receiver.buffers)
        landing = ShmLanding(LAYOUT, segment.name, segment.memory, 0, payloads, host_id())
        try:
            await receiver.fetch_from(("127.0.0.1", port), tokens, 0, num_blocks, install, landing)
        finally:
            shm.give_back(segment)
        return time.perf_counter() - started

    return total / asyncio.run(fetch()) / 1e9


def first_transfer_rate(port: int, total: int) -> float:
    """A decode worker's first transfer: its receiver started (the first segment made,
    as at the worker's start, untimed; sized as for a worker whose largest transfer
    fills what it keeps, as a real model's long prompts do), then one transfer timed."""
    largest = max(total, SEGMENT_KEEP_BYTES)
    receiver = TCPKVReceiver(
        LAYOUT, frame_timeout_s=60.0, max_transfer_blocks=largest // LAYOUT.block_nbytes
    )
    asyncio.run(receiver.start())
    try:
        return tcp_rate(port, total, receiver, receiver.segments)
    finally:
        receiver.close()


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
    parser.add_argument("--no-mooncake", action="store_true", help="leave Mooncake TCP out")
    parser.add_argument(
        "--fresh-memory", action="store_true", help="add kvserve TCP receiving into fresh memory"
    )
    parser.add_argument(
        "--unmerged", action="store_true", help="add kvserve TCP sending one frame per run"
    )
    parser.add_argument(
        "--fresh-segment", action="store_true", help="add kvserve shm into a new segment"
    )
    parser.add_argument(
        "--first-transfer", action="store_true", help="add a started receiver's first transfer"
    )
    args = parser.parse_args()
    total, run = args.megabytes * MB, args.run_megabytes * MB
    torch.set_num_threads(1)
    context = mp.get_context("spawn")
    peers: list[tuple[Connection, mp.process.BaseProcess]] = []

    def peer(target: Any, *extra: Any) -> Connection:
        pipe, child = context.Pipe()
        process = context.Process(target=target, args=(child, *extra), daemon=True)
        process.start()
        peers.append((pipe, process))
        return pipe

    raw_pipe = peer(_socket_receiver, total)
    tcp_pipe = peer(_tcp_sender, total, run, MERGE_BYTES)
    raw_port, tcp_port = raw_pipe.recv(), tcp_pipe.recv()
    receivers = [TCPKVReceiver(LAYOUT, frame_timeout_s=60.0) for _ in range(3)]
    paths: dict[str, Callable[[], float]] = {
        "memcpy": lambda: memcpy_rate(total, run),
        "raw socket": lambda: socket_rate(raw_pipe, raw_port, total, run),
        "kvserve TCP": lambda: tcp_rate(tcp_port, total, receivers[0]),
        "kvserve shm": lambda: tcp_rate(tcp_port, total, receivers[0], receivers[0].segments),
    }
    if args.fresh_segment:
        fresh = SegmentPool(keep_bytes=0)
        paths["shm, fresh"] = lambda: tcp_rate(tcp_port, total, receivers[0], fresh)
    if args.first_transfer:
        paths["shm, first"] = lambda: first_transfer_rate(tcp_port, total)
    if args.unmerged:
        unmerged_port = peer(_tcp_sender, total, run, 0).recv()
        paths["kvserve, unmerged"] = lambda: tcp_rate(unmerged_port, total, receivers[1])
    if args.fresh_memory:
        receivers[2].buffers = RunBuffers(keep_bytes=0)
        paths["kvserve, fresh"] = lambda: tcp_rate(tcp_port, total, receivers[2])
    if not args.no_mooncake:
        from mooncake.engine import TransferEngine

        mc_pipe = peer(_mooncake_receiver, total, run)
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        mc_peer = mc_pipe.recv()
        paths["Mooncake TCP"] = lambda: mooncake_rate(mc_pipe, engine, mc_peer, total, run)
    rates: dict[str, list[float]] = {name: [] for name in paths}
    load_before = os.getloadavg()[0]
    try:
        for _ in range(args.rounds):  # alternating, so a burst of load hits every path
            for name, measure in paths.items():
                rates[name].append(measure())
    finally:
        for receiver in receivers:
            receiver.close()  # unlinks the segments it kept
        for pipe, process in peers:
            pipe.send(False)
            process.join(5)
    memcpy = statistics.median(rates["memcpy"])
    print(f"{args.megabytes} MiB in runs of {args.run_megabytes} MiB, median of {args.rounds}; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after on "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'path':<14}{'GB/s':>8}{'x memcpy':>10}   rounds (GB/s)")
    for name, samples in rates.items():
        rate = statistics.median(samples)
        each = " ".join(f"{sample:.2f}" for sample in samples)
        print(f"{name:<14}{rate:>8.2f}{rate / memcpy:>10.3f}   {each}")


if __name__ == "__main__":
    main()
