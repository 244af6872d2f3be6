"""PD KV transfer over the Mooncake Transfer Engine (``--kv-transfer mooncake``).

The conversation stays the TCP one (:mod:`kvserve.worker.tcp_kv_transfer`): the decode
worker opens a control connection, asks for a prompt's blocks, receives one frame per
run and ``done`` or ``error``; the connection is still the transfer's lifetime, so the
lease, its fences and cancellation work exactly as with TCP. Only the bytes take
another path: the decode worker registers a buffer for the transfer with its transfer
engine and names it in the request (its engine's session ``host:rpc_port`` and the
buffer's address); the prefill worker writes each run straight into it with
``transfer_sync_write`` (RDMA where the cluster has it, Mooncake's TCP elsewhere) and
then sends the run's frame without a payload. Peers find each other through these
requests: no etcd, no metadata server (``P2PHANDSHAKE``).

A peer that is gone fails the write at once (code -1): the prefill side drops the
export and hangs up, the decode side falls back as with TCP. Either side speaks to a
TCP peer too: a request without a buffer gets payload frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import torch
from mooncake.engine import TransferEngine

from kvserve.engine.kv_block_io import KVBlockLayout
from kvserve.worker.kv_transfer import ExportSource
from kvserve.worker.pd_wire import send_frame
from kvserve.worker.run_buffers import RunBuffers
from kvserve.worker.shm_landing import Segment
from kvserve.worker.tcp_kv_transfer import Landing, PayloadLanding, TCPKVReceiver, TCPKVSender

# After a failed or cancelled transfer the prefill side may still be writing into the
# buffer: it is kept (registered) this long before it is released.
_QUARANTINE_S = 30.0


class MooncakeEngine:
    """One worker's Mooncake transfer engine, found by peers as ``session``."""

    def __init__(self, host: str, protocol: str = "tcp", device: str = "") -> None:
        self._engine = TransferEngine()
        code = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if code != 0:
            raise RuntimeError(f"the Mooncake transfer engine did not start on {host}: {code}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"

    def register(self, buffer: torch.Tensor) -> None:
        if self._engine.register_memory(buffer.data_ptr(), buffer.nbytes) != 0:
            raise OSError("mooncake could not register a transfer buffer")

    def unregister(self, buffer: torch.Tensor) -> None:
        self._engine.unregister_memory(buffer.data_ptr())

    def write(self, session: str, source: torch.Tensor, address: int) -> int:
        """Blocking: ``source`` into the peer's registered memory at ``address``; 0 = ok."""
        code: int = self._engine.transfer_sync_write(
            session, source.data_ptr(), address, source.nbytes
        )
        return code


class MooncakeKVSender(TCPKVSender):
    """A prefill worker's side: TCP control connections, bytes written by the engine."""

    def __init__(
        self, exports: ExportSource, layout: KVBlockLayout, host: str, engine: MooncakeEngine
    ) -> None:
        super().__init__(exports, layout, host)
        self._engine = engine

    def info(self) -> dict[str, Any]:
        return super().info() | {"transfer": "mooncake", "mooncake_session": self._engine.session}

    def _send_runs(
        self, sock: socket.socket, request: dict[str, Any], first_block: int,
        runs: list[torch.Tensor],
    ) -> None:  # fmt: skip
        if request.get("mooncake") is None:  # a TCP decode worker
            super()._send_runs(sock, request, first_block, runs)
            return
        for run in runs:
            self._write_run(sock, request, first_block, run)
            first_block += len(run)

    def _write_run(
        self, sock: socket.socket, request: dict[str, Any], first_block: int, blocks: torch.Tensor
    ) -> None:
        """One run written into the decode worker's buffer by the engine, then its frame."""
        target = request["mooncake"]
        source = blocks.contiguous().view(torch.uint8).reshape(-1)
        offset = (first_block - int(request["first_block"])) * self._layout.block_nbytes
        if offset < 0 or offset + source.nbytes > int(target["bytes"]):
            raise ValueError(f"run at block {first_block} does not fit the decode buffer")
        self._engine.register(source)
        try:
            code = self._engine.write(
                str(target["session"]), source, int(target["address"]) + offset
            )
        finally:
            self._engine.unregister(source)
        if code != 0:  # the decode worker is gone: drop the export, as a hang-up would
            raise OSError(f"mooncake write to {target['session']} failed: {code}")
        header = {"type": "blocks", "first_block": first_block, "num_blocks": len(blocks)}
        send_frame(sock, header | {"placed": True})


class _BufferLanding:
    """One transfer's registered buffer: runs are written into it by the prefill side."""

    def __init__(
        self, layout: KVBlockLayout, engine: MooncakeEngine, buffer: torch.Tensor,
        buffers: RunBuffers,
    ) -> None:  # fmt: skip
        self._layout = layout
        self._engine = engine
        self._buffer = buffer
        self._buffers = buffers
        self._first_block = 0

    def request_fields(self) -> dict[str, Any]:
        return {
            "mooncake": {
                "session": self._engine.session,
                "address": self._buffer.data_ptr(),
                "bytes": self._buffer.nbytes,
            }
        }

    def start(self, first_block: int) -> None:
        self._first_block = first_block

    def run_blocks(
        self, header: dict[str, Any], payload_len: int, sock: socket.socket
    ) -> torch.Tensor:
        if not header.get("placed"):  # a TCP prefill worker sent the bytes in the frame
            return PayloadLanding(self._layout, self._buffers).run_blocks(header, payload_len, sock)
        if payload_len:
            raise ValueError(f"a placed run {header!r} with a payload")
        size = self._layout.block_nbytes
        start = (int(header["first_block"]) - self._first_block) * size
        end = start + int(header["num_blocks"]) * size
        if start < 0 or end > self._buffer.nbytes:
            raise ValueError(f"run {header!r} lies outside the transfer buffer")
        run = self._buffers.take(end - start)  # the transfer buffer is written on meanwhile
        run.copy_(self._buffer[start:end])
        return run.view(self._layout.torch_dtype).reshape(-1, *self._layout.block_shape)

    def give_back(self, run: torch.Tensor) -> None:
        self._buffers.give_back(run)


class MooncakeKVReceiver(TCPKVReceiver):
    """A decode worker's side: one registered buffer per transfer, named in its request."""

    def __init__(
        self,
        layout: KVBlockLayout,
        engine: MooncakeEngine,
        frame_timeout_s: float,
        api_key: str | None = None,
    ) -> None:
        super().__init__(layout, frame_timeout_s, api_key=api_key, same_host_shm=False)
        self._engine = engine

    @contextlib.contextmanager
    def _landing(
        self, first_block: int, num_blocks: int, segment: Segment | None
    ) -> Iterator[Landing]:
        size = (num_blocks - first_block) * self._layout.block_nbytes
        if size <= 0:
            yield PayloadLanding(self._layout, self.buffers)
            return
        buffer = torch.empty(size, dtype=torch.uint8)
        self._engine.register(buffer)
        landing = _BufferLanding(self._layout, self._engine, buffer, self.buffers)
        landing.start(first_block)
        finished = False
        try:
            yield landing
            finished = True
        finally:
            if finished:  # every run was announced: no write is in flight
                self._engine.unregister(buffer)
            else:
                asyncio.get_running_loop().call_later(
                    _QUARANTINE_S, self._engine.unregister, buffer
                )
