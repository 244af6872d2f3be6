"""The prefill worker's half of prefill/decode disaggregation: exporting a prompt's KV.

A prompt to prefill for another worker runs as an ordinary request over the prompt's
full blocks plus one token (:func:`start_export`), so it matches this worker's prefix
cache and commits what it computes (the next request with the same prefix hits here).
After every step the :class:`PDExporter` connector copies the blocks completed so far
out (:mod:`kv_block_io`) and hands them to the export's sink, so the transfer of early
blocks overlaps the computation of later chunks. Once the last block is out the engine
drops the request, without output; its blocks stay cached. An export whose request
ends first (aborted, rejected, a failed step) tells its sink it failed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.kv_block_io import read_blocks
from kvserve.engine.kv_connector import ConnectorContext, KVConnector

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

# Two tokens, no EOS: the request is still running, its block table readable, when the
# last block is shipped; it is dropped then.
_EXPORT_PARAMS = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)


class ExportSink(Protocol):
    """Where an export's blocks go; called on the engine thread, must not block."""

    def blocks(self, first_block: int, blocks: torch.Tensor) -> None: ...
    def done(self, cached_tokens: int) -> None: ...
    def failed(self, message: str) -> None: ...


@dataclass(slots=True)
class _Export:
    sink: ExportSink
    next_block: int
    num_blocks: int


class PDExporter(KVConnector):
    def __init__(self, context: ConnectorContext) -> None:
        self._pool, self.layout = context.require_pool("PD transfers")
        self._cache = context.kv_cache
        self._exports: dict[str, _Export] = {}

    def track(self, export_id: str, first_block: int, num_blocks: int, sink: ExportSink) -> None:
        """Ship blocks ``[first_block, num_blocks)`` of the queued request ``export_id``."""
        self._exports[export_id] = _Export(sink, first_block, num_blocks)

    def after_step(self, plan: SchedulerOutput) -> list[str]:
        if not self._exports:
            return []
        block_size = self._cache.block_size
        shipped = []
        for chunk in plan.chunks:
            request = chunk.request
            export = self._exports.get(request.request_id)
            if export is None:
                continue
            ready = min(request.num_computed_tokens // block_size, export.num_blocks)
            if ready > export.next_block:
                table = self._cache.block_table(request.request_id)[export.next_block : ready]
                export.sink.blocks(export.next_block, read_blocks(self._pool, self.layout, table))
                export.next_block = ready
            if ready == export.num_blocks:
                del self._exports[request.request_id]
                export.sink.done(request.num_cached_tokens or 0)
                shipped.append(request.request_id)
        return shipped

    def request_finished(self, request: Request) -> None:
        export = self._exports.pop(request.request_id, None)
        if export is not None:
            export.sink.failed("the prefill request ended before its blocks were computed")

    def step_failed(self, error: Exception) -> list[str]:
        failed = list(self._exports)
        for export in self._exports.values():
            export.sink.failed(f"prefill step failed: {error!r}")
        self._exports.clear()
        return failed


def start_export(
    engine: LLMEngine,
    export_id: str,
    token_ids: list[int],
    first_block: int,
    num_blocks: int,
    sink: ExportSink,
    cache_salt: str | None = None,
) -> None:
    """Compute blocks ``[0, num_blocks)`` of ``token_ids`` on ``engine`` (built with a
    :class:`PDExporter`); ship ``[first_block, ...)`` to ``sink``. The decode request's
    ``cache_salt`` keys the blocks here as it does there. Engine thread only."""
    block_size = engine.kv_cache.block_size
    if not 0 <= first_block < num_blocks or num_blocks * block_size >= len(token_ids):
        raise InvalidRequestError(
            "num_blocks", f"cannot export blocks [{first_block}, {num_blocks})"
        )
    exporter = engine.connector(PDExporter)
    params = replace(_EXPORT_PARAMS, cache_salt=cache_salt)
    engine.add_request(export_id, token_ids[: num_blocks * block_size + 1], params)
    exporter.track(export_id, first_block, num_blocks, sink)
