"""The decode worker's side of one disaggregated request.

:class:`PDDecodeSession` stands where :class:`EngineBridge` stands for an ordinary request
(``generate``, ``abort``, ``engine``), so the OpenAI response code serves PD requests
unchanged. Its ``generate`` reserves blocks under a lease, has the prefill worker compute
and send them (or prefills here: conditional disaggregation), then hands the request to
the engine, which computes only the prompt's tail and decodes.

The blocks travel by the worker's :class:`~kvserve.worker.kv_transfer.KVTransferReceiver`.
Whatever goes wrong with the prefill worker (unreachable, dies mid-transfer, stalls past
the lease, refuses) the request is prefilled here instead: blocks installed so far stay
cached and count. If the client leaves during the transfer, the transfer is cancelled
(which cancels the export on the prefill worker) and the lease released at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import torch
from starlette.types import Receive

from kvserve.engine.pd_import import PDImporter, Reservation
from kvserve.worker.engine_bridge import EngineBridge, RequestStream
from kvserve.worker.errors import APIError
from kvserve.worker.kv_transfer import KVTransferError, KVTransferReceiver

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class _ReportedCache:
    """A request stream whose outputs report ``cached_tokens`` as the PD path saw them:
    the decode worker's installed blocks are the prefill worker's hits or work."""

    def __init__(self, stream: RequestStream, cached_tokens: int) -> None:
        self._stream = stream
        self._cached_tokens = cached_tokens

    @property
    def finished(self) -> bool:
        return self._stream.finished

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for output in self._stream:
            yield dataclasses.replace(output, num_cached_tokens=self._cached_tokens)


class PDDecodeSession:
    """One PD request on the decode worker; ``path`` tells how its prompt was prefilled:
    ``remote``, ``local`` (conditional) or ``fallback`` (the prefill worker failed)."""

    def __init__(
        self,
        bridge: EngineBridge,
        importer: PDImporter,  # of the engine behind ``bridge``: touched on its thread only
        receiver: KVTransferReceiver,
        prefill_url: str | None,
        receive: Receive,
    ) -> None:
        self.engine = bridge.engine
        self._bridge = bridge
        self._importer = importer
        self._receiver = receiver
        self._prefill_url = prefill_url
        self._receive = receive
        self.path = "local"

    def abort(self, request_id: str) -> None:
        self._bridge.abort(request_id)  # a handed-over lease ends with its request

    async def generate(self, request_id: str, prompt: Any, params: Any) -> Any:
        if self._prefill_url is None:
            return await self._bridge.generate(request_id, prompt, params)
        bridge, importer = self._bridge, self._importer

        def reserve(engine: LLMEngine) -> Reservation:
            token_ids = engine.prompt_token_ids(prompt)
            return importer.reserve(
                request_id, token_ids, time.monotonic(), params.cache_salt, params.max_tokens
            )

        def release(_: LLMEngine) -> None:
            importer.release(request_id)

        reservation = await bridge.call(reserve)
        if not reservation.remote:
            return await bridge.generate(request_id, reservation.token_ids, params)
        block_size = self.engine.kv_cache.block_size
        try:
            cached = await self._transfer(
                request_id, reservation, self._prefill_url, params.cache_salt
            )
            cached = max(cached, reservation.num_cached_blocks * block_size)
            self.path = "remote"
        except KVTransferError as exc:
            logger.warning("PD transfer failed, prefilling here: %s", exc)
            bridge.post(release)
            self.path = "fallback"
            return await bridge.generate(request_id, reservation.token_ids, params)
        except BaseException:
            bridge.post(release)
            raise
        try:
            stream = await bridge.generate(request_id, reservation.token_ids, params)
        except BaseException:
            bridge.post(release)
            raise
        return _ReportedCache(stream, cached)

    async def _transfer(
        self,
        request_id: str,
        reservation: Reservation,
        prefill_url: str,
        cache_salt: str | None,
    ) -> int:
        """Fetch and install the blocks; APIError(499) if the client leaves meanwhile."""
        bridge, importer = self._bridge, self._importer

        async def install(first_block: int, blocks: torch.Tensor) -> None:
            def write(_: LLMEngine) -> None:
                importer.install(request_id, first_block, blocks, time.monotonic())

            await bridge.call(write)

        fetch = self._receiver.fetch(
            prefill_url,
            reservation.token_ids,
            reservation.num_cached_blocks,
            reservation.num_blocks,
            install,
            cache_salt,
        )
        fetching = asyncio.ensure_future(fetch)
        watcher = asyncio.ensure_future(_client_gone(self._receive))
        try:
            await asyncio.wait({fetching, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            fetching.cancel()
        if not fetching.done() or fetching.cancelled():
            raise APIError(499, "the client closed the connection", code="client_gone")
        return fetching.result()


async def _client_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
