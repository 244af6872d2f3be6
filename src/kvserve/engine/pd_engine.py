"""The engine's two halves of prefill/decode disaggregation (DESIGN.md §7).

**Prefill side (export).** A prompt to prefill for another worker runs as an ordinary
request over the prompt's full blocks plus one token, so it matches this worker's prefix
cache and publishes what it computes (the next request with the same prefix hits here).
After every step the blocks completed so far are copied out (:mod:`kv_block_io`) and
handed to the export's sink, so the transfer of early blocks overlaps the computation of
later chunks. Once the last block is out the request is dropped; its blocks stay cached.

**Decode side (reserve, install, hand over).** A reservation matches the prompt in this
worker's cache (pinned) and allocates the rest of its full blocks under a lease id. The
blocks are owned by the lease, not in the prefix tree, so nothing can read them before
they are installed; each received run is written, then published. Handing over is an
ordinary :meth:`add_request`: the request matches every installed block, computes only
the tail (the tokens after the last full block, whose logits it needs), and decodes.
The lease keeps its pins until the request is admitted, so no eviction can take the
blocks in between; a lease that lapses (sender dead or stalled) gives its blocks back.

Every method runs on the engine's own thread (the worker sends them as commands).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvserve.core.hashing import block_hashes
from kvserve.core.kv_lease import LeaseTable
from kvserve.core.request import RequestStatus
from kvserve.core.routing.pd_pair import PDConfig, prefill_remotely
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.kv_block_io import KVBlockLayout, read_blocks, write_blocks
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestOutput

DEFAULT_LEASE_TTL_S = 30.0


class LeaseLost(RuntimeError):
    """Blocks arrived for a reservation that expired or was released."""


class ExportSink(Protocol):
    """Where an export's blocks go; called on the engine thread, must not block."""

    def blocks(self, first_block: int, blocks: torch.Tensor) -> None: ...
    def done(self, cached_tokens: int) -> None: ...
    def failed(self, message: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Reservation:
    token_ids: list[int]
    num_blocks: int  # full blocks before the prompt's last token: what a transfer fills
    num_cached_blocks: int  # of those, already in this worker's cache
    remote: bool  # False: prefill here (conditional disaggregation); nothing is held


@dataclass(slots=True)
class _Export:
    sink: ExportSink
    next_block: int
    num_blocks: int


@dataclass(slots=True)
class _Reserved:
    hashes: list[int]
    next_block: int
    handed_over: bool = False


def _lease_key(lease_id: str) -> str:
    """The lease's blocks sit in the KV cache manager beside the request of the same id."""
    return f"lease:{lease_id}"


class PDEngine(LLMEngine):
    def __init__(
        self,
        *args: Any,
        pd_config: PDConfig | None = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.pd_config = pd_config or PDConfig()
        self.lease_ttl_s = lease_ttl_s
        self.kv_layout = KVBlockLayout.of_runner(self.runner, self.model_name)
        self.leases = LeaseTable()
        self._exports: dict[str, _Export] = {}
        self._reserved: dict[str, _Reserved] = {}

    # -- prefill side ----------------------------------------------------------------

    def start_export(
        self,
        export_id: str,
        token_ids: list[int],
        first_block: int,
        num_blocks: int,
        sink: ExportSink,
    ) -> None:
        """Compute blocks ``[0, num_blocks)`` of ``token_ids``; ship ``[first_block, ...)``."""
        block_size = self.kv_cache.block_size
        if not 0 <= first_block < num_blocks or num_blocks * block_size >= len(token_ids):
            raise InvalidRequestError(
                "num_blocks", f"cannot export blocks [{first_block}, {num_blocks})"
            )
        # Two tokens, no EOS: the request is still running, its block table readable, when
        # the last block is shipped; it is dropped then.
        params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
        self.add_request(export_id, token_ids[: num_blocks * block_size + 1], params)
        self._exports[export_id] = _Export(sink, first_block, num_blocks)

    def step(self) -> list[RequestOutput]:
        try:
            outputs = super().step()
        except Exception as exc:
            for export in self._exports.values():
                export.sink.failed(f"prefill step failed: {exc!r}")
            for export_id in list(self._exports):
                self.abort_request(export_id)
            raise
        if self._exports:
            outputs = [o for o in outputs if o.request_id not in self._exports]
            self._ship_exports()
        if self._reserved:
            self._release_admitted()
        return outputs

    def _ship_exports(self) -> None:
        block_size = self.kv_cache.block_size
        for export_id, export in list(self._exports.items()):
            generation = self._generations.get(export_id)
            if generation is None:  # rejected or finished early: nothing more will come
                del self._exports[export_id]
                export.sink.failed("the prefill request ended before its blocks were computed")
                continue
            request = generation.request
            ready = min(request.num_computed_tokens // block_size, export.num_blocks)
            if ready > export.next_block:
                table = self.kv_cache.block_table(export_id)[export.next_block : ready]
                export.sink.blocks(
                    export.next_block, read_blocks(self.runner.kv_pool, self.kv_layout, table)
                )
                export.next_block = ready
            if ready == export.num_blocks:
                self.abort_request(export_id)
                export.sink.done(request.num_cached_tokens or 0)

    # -- decode side -----------------------------------------------------------------

    def reserve(self, lease_id: str, prompt: str | list[int], now: float) -> Reservation:
        """Match the prompt here and, if a prefill worker should compute the rest, hold
        blocks for it under a lease. Raises :class:`InvalidRequestError` on a bad prompt."""
        token_ids = self._prompt_token_ids(prompt)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(token_ids)} tokens; the context holds "
                f"{self.max_model_len} and at least one must be generated",
            )  # fmt: skip
        block_size = self.kv_cache.block_size
        num_blocks = (len(token_ids) - 1) // block_size
        hashes = block_hashes(token_ids[: num_blocks * block_size], block_size, self.namespace)
        key = _lease_key(lease_id)
        cached = self.kv_cache.match_prefix(key, hashes)
        remote = prefill_remotely(len(token_ids), cached * block_size, self.pd_config)
        if not (remote and self.kv_cache.allocate_slots(key, num_blocks * block_size)):
            self.kv_cache.free_request(key)  # prefill here; the scheduler queues it
            return Reservation(token_ids, num_blocks, cached, remote=False)
        self.leases.grant(lease_id, now, self.lease_ttl_s)
        self._reserved[lease_id] = _Reserved(hashes, next_block=cached)
        return Reservation(token_ids, num_blocks, cached, remote=True)

    def install(self, lease_id: str, first_block: int, blocks: torch.Tensor, now: float) -> None:
        """Write a run of received blocks into the lease's blocks, then publish them."""
        reserved = self._reserved.get(lease_id)
        if reserved is None or reserved.handed_over or not self.leases.renew(lease_id, now):
            raise LeaseLost(f"no live reservation {lease_id!r}")
        end = first_block + blocks.shape[0]
        if first_block != reserved.next_block or end > len(reserved.hashes):
            raise ValueError(
                f"blocks [{first_block}, {end}) do not continue [0, {reserved.next_block}) "
                f"of {len(reserved.hashes)}"
            )
        key = _lease_key(lease_id)
        table = self.kv_cache.block_table(key)[first_block:end]
        write_blocks(self.runner.kv_pool, self.kv_layout, table, blocks)
        self.kv_cache.commit_blocks(key, reserved.hashes[:end])
        reserved.next_block = end

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """A request with the id of a reservation takes its blocks over."""
        super().add_request(request_id, prompt, params)
        reserved = self._reserved.get(request_id)
        if reserved is not None:
            self.leases.release(request_id)  # no deadline once handed over
            reserved.handed_over = True

    def abort_request(self, request_id: str) -> None:
        """Also ends the reservation or export of that id, if any."""
        super().abort_request(request_id)
        self._exports.pop(request_id, None)
        self.release_lease(request_id)

    def release_lease(self, lease_id: str) -> None:
        """Give back what the lease holds; blocks already installed stay cached."""
        self.leases.release(lease_id)
        if self._reserved.pop(lease_id, None) is not None:
            self.kv_cache.free_request(_lease_key(lease_id))

    def expire_leases(self, now: float | None = None) -> int:
        """Free the blocks of every lapsed lease; returns how many lapsed."""
        lapsed = self.leases.expire(time.monotonic() if now is None else now)
        for lease in lapsed:
            self.release_lease(lease.lease_id)
        return len(lapsed)

    def _release_admitted(self) -> None:
        """A handed-over request pins its blocks once admitted: the lease can let go."""
        for lease_id, reserved in list(self._reserved.items()):
            if not reserved.handed_over:
                continue
            generation = self._generations.get(lease_id)
            if generation is None or generation.request.status is not RequestStatus.WAITING:
                self.release_lease(lease_id)
