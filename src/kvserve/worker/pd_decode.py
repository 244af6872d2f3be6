"""The decode worker's side of one disaggregated request.

:class:`PDDecodeSession` stands where :class:`AsyncEngine` stands for an ordinary request
(``generate``, ``abort``, ``engine``), so the OpenAI response code serves PD requests
unchanged. Its ``generate`` reserves blocks under a lease, has the prefill worker compute
and send them (or prefills here: conditional disaggregation), then hands the request to
the engine, which computes only the prompt's tail and decodes.

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
from typing import Any

import aiohttp
import torch
from starlette.types import Receive

from kvserve.engine.kv_block_io import KVBlockLayout
from kvserve.worker.async_engine import AsyncEngine, RequestStream
from kvserve.worker.errors import APIError
from kvserve.worker.pd_transfer import TRANSFER_ERRORS, fetch_blocks

logger = logging.getLogger(__name__)

# Any of these from the prefill side means: prefill here instead.
_FALLBACK_ERRORS = (*TRANSFER_ERRORS, aiohttp.ClientError, KeyError)


class PrefillPeers:
    """Transfer addresses of prefill workers by URL, learned from their ``/pd/info``."""

    def __init__(self, timeout_s: float) -> None:
        self._addresses: dict[str, tuple[str, int]] = {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def address(self, url: str) -> tuple[str, int]:
        known = self._addresses.get(url)
        if known is not None:
            return known
        async with (
            aiohttp.ClientSession(timeout=self._timeout) as session,
            session.get(url.rstrip("/") + "/pd/info") as response,
        ):
            response.raise_for_status()
            info = await response.json()
        address = self._addresses[url] = (str(info["transfer_host"]), int(info["transfer_port"]))
        return address

    def forget(self, url: str) -> None:
        """After a failed transfer: the worker may have restarted on another port."""
        self._addresses.pop(url, None)


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
        bridge: AsyncEngine,
        peers: PrefillPeers,
        prefill_url: str | None,
        receive: Receive,
    ) -> None:
        self.engine = bridge.engine
        self._bridge = bridge
        self._peers = peers
        self._prefill_url = prefill_url
        self._receive = receive
        self.path = "local"

    def abort(self, request_id: str) -> None:
        self._bridge.abort(request_id)  # the engine also ends a lease of that id

    async def generate(self, request_id: str, prompt: Any, params: Any) -> Any:
        if self._prefill_url is None:
            return await self._bridge.generate(request_id, prompt, params)
        bridge = self._bridge
        reservation = await bridge.call(lambda e: e.reserve(request_id, prompt, time.monotonic()))
        if not reservation.remote:
            return await bridge.generate(request_id, reservation.token_ids, params)
        block_size = self.engine.kv_cache.block_size
        try:
            cached = await self._transfer(request_id, reservation, self._prefill_url)
            cached = max(cached, reservation.num_cached_blocks * block_size)
            self.path = "remote"
        except _FALLBACK_ERRORS as exc:
            logger.warning(
                "PD transfer from %s failed, prefilling here: %r", self._prefill_url, exc
            )
            self._peers.forget(self._prefill_url)
            bridge.post(lambda e: e.release_lease(request_id))
            self.path = "fallback"
            return await bridge.generate(request_id, reservation.token_ids, params)
        except BaseException:
            bridge.post(lambda e: e.release_lease(request_id))
            raise
        try:
            stream = await bridge.generate(request_id, reservation.token_ids, params)
        except BaseException:
            bridge.post(lambda e: e.release_lease(request_id))
            raise
        return _ReportedCache(stream, cached)

    async def _transfer(self, request_id: str, reservation: Any, prefill_url: str) -> int:
        """Fetch and install the blocks; APIError(499) if the client leaves meanwhile."""
        bridge = self._bridge
        engine = self.engine

        async def install(first_block: int, blocks: torch.Tensor) -> None:
            await bridge.call(
                lambda e: e.install(request_id, first_block, blocks, time.monotonic())
            )

        async def fetch() -> int:
            address = await self._peers.address(prefill_url)
            layout: KVBlockLayout = engine.kv_layout
            return await fetch_blocks(
                address,
                layout,
                reservation.token_ids,
                reservation.num_cached_blocks,
                reservation.num_blocks,
                install,
                engine.lease_ttl_s,
            )

        fetching = asyncio.ensure_future(fetch())
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
