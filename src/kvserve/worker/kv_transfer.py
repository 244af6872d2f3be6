"""How KV blocks travel from a prefill worker to a decode worker: the interface.

The prefill worker runs a :class:`KVTransferSender` while it serves: it accepts transfer
requests from decode workers, starts each as an export on its engine
(:func:`kvserve.engine.pd_export.start_export`) and sends the blocks as the engine hands
them over. The decode worker's :class:`KVTransferReceiver` asks a prefill worker (known
by its HTTP URL) for a prompt's blocks and installs each run as it arrives. Neither the
engine nor its PD connectors know how the bytes travel: the TCP implementation
(:mod:`kvserve.worker.tcp_kv_transfer`) is the default, and another (e.g. an RDMA
transfer engine) implements these two classes and plugs in beside it
(:func:`kvserve.worker.pd_api.transfer_for`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvserve.engine.pd_export import ExportSink, start_export
from kvserve.worker.engine_bridge import EngineBridge

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

# Writes a run of received blocks (first block index, blocks) into the reservation. The
# blocks' memory is reused for later runs once it returns: it must keep no reference.
InstallRun = Callable[[int, torch.Tensor], Awaitable[None]]


class KVTransferError(RuntimeError):
    """The transfer failed (peer unreachable, gone, stalled or refusing; a run that does
    not fit the reservation): the decode worker prefills the prompt itself."""


class ExportSource(Protocol):
    """What a sender serves: exports of prompts' blocks, each handed to its sink as the
    blocks are computed. :class:`EngineExports` in a worker; a benchmark feeds ready
    blocks to measure the transfer alone."""

    async def start(
        self, export_id: str, token_ids: list[int], first_block: int, num_blocks: int,
        sink: ExportSink, cache_salt: str | None,
    ) -> None:  # fmt: skip
        """Begin the export (its blocks keyed by ``cache_salt``, as the decode side's
        are); raises on a request the engine refuses."""

    def abort(self, export_id: str) -> None:
        """Drop a started export (its sink hears nothing more that matters)."""


class EngineExports:
    """Exports computed by the engine behind ``bridge`` (built with a ``PDExporter``)."""

    def __init__(self, bridge: EngineBridge) -> None:
        self._bridge = bridge

    async def start(
        self, export_id: str, token_ids: list[int], first_block: int, num_blocks: int,
        sink: ExportSink, cache_salt: str | None,
    ) -> None:  # fmt: skip
        def start(engine: LLMEngine) -> None:
            start_export(engine, export_id, token_ids, first_block, num_blocks, sink, cache_salt)

        await self._bridge.call(start)

    def abort(self, export_id: str) -> None:
        self._bridge.post(lambda engine: engine.abort_request(export_id))


class KVTransferSender(Protocol):
    """A prefill worker's side; runs on the worker's event loop."""

    async def start(self) -> None:
        """Start accepting transfers."""

    async def close(self) -> None:
        """Stop accepting; cancel every transfer (their exports are dropped)."""

    def info(self) -> dict[str, Any]:
        """What ``/pd/info`` tells decode workers about reaching this sender."""


class KVTransferReceiver(Protocol):
    """A decode worker's side; runs on the worker's event loop."""

    async def start(self) -> None:
        """Prepare, before the worker serves, what its first transfer would otherwise
        wait for."""

    async def fetch(
        self,
        prefill_url: str,
        token_ids: list[int],
        first_block: int,
        num_blocks: int,
        install: InstallRun,
        cache_salt: str | None = None,
    ) -> int:
        """Have the prefill worker at ``prefill_url`` compute blocks ``[0, num_blocks)`` of
        the prompt and ``install`` ``[first_block, num_blocks)`` in order as they come;
        returns the prompt tokens its cache served (its blocks keyed by ``cache_salt``, as
        the decode request's are). Raises :class:`KVTransferError` on any failure;
        cancelling the call cancels the transfer."""

    def close(self) -> None:
        """Release what is kept for later transfers (the worker stops)."""
