"""The router in prefill/decode mode: the pair chosen together, one request to the decode
worker, guards on both workers.

The router sends the client's body to the decode worker's ``/pd/v1/...`` with the chosen
prefill worker in ``x-kvserve-prefill`` (absent when the prefill is predicted local);
the decode worker reserves, pulls the KV from the prefill worker and streams the answer
back (see ``docs/internals.md``, PD protocol). Routing state is per pool: the prefill
pool's index learns only from prefill choices, the decode pool's only from decode
choices, and decode KV headroom comes from the decode workers' ``/load``.

Responses name the decode worker in ``x-kvserve-worker``, relay its ``x-kvserve-pd``
(``remote``, ``local``, ``fallback``) and, when the prefill worker's KV was used
(``remote``), name that worker in ``x-kvserve-prefill-worker``.

Guards: the prefill worker's (one request + the prompt's prefill tokens) is released when
prefill ends, i.e. at the first response byte; the decode worker's (one request) when the
response ends. Both are released on every path through the base proxy's ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from kvserve.core.routing.cache_aware import CacheAwareIndex
from kvserve.core.routing.pd_pair import DecodeCandidate, PDConfig, choose_pair
from kvserve.core.routing.tie_breaking import Rotation
from kvserve.core.routing.types import RouteQuery, RoutingDecision
from kvserve.router.load_guard import LoadGuard
from kvserve.router.proxy import Proxy
from kvserve.router.worker_registry import Worker

PREFILL_HEADER = "x-kvserve-prefill"
PATH_HEADER = "x-kvserve-pd"  # the decode worker's answer: remote | local | fallback
PREFILL_WORKER_HEADER = "x-kvserve-prefill-worker"
LOAD_POLL_INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class PairDecision(RoutingDecision):
    """The decode worker is the one answering; the prefill worker rides along."""

    prefill_worker_id: str | None = None

    def header_value(self) -> str:
        return f"{RoutingDecision.header_value(self)}; prefill={self.prefill_worker_id or 'local'}"


def _prefill_worker_id(decision: RoutingDecision) -> str | None:
    return decision.prefill_worker_id if isinstance(decision, PairDecision) else None


class PairGuard:
    """Both stages' guards behind the one-guard interface the base proxy uses."""

    def __init__(self, decode: LoadGuard, prefill: LoadGuard | None) -> None:
        self._decode = decode
        self._prefill = prefill

    @property
    def prefill_released(self) -> bool:
        return self._decode.prefill_released

    def release_prefill(self) -> None:
        """The first byte came: the prefill worker's part is over."""
        if self._prefill is not None:
            self._prefill.release()
        self._decode.release_prefill()

    def release(self) -> None:
        if self._prefill is not None:
            self._prefill.release()
        self._decode.release()


class PDProxy(Proxy):
    def __init__(self, *args: object, pd_config: PDConfig, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._pd_config = pd_config
        self._index = CacheAwareIndex(self._config.cache_aware, self._clock())
        self._rotation = Rotation()
        self._free_fraction: dict[str, float] = {}  # decode worker -> free/total blocks

    # -- selection -------------------------------------------------------------------

    async def _prepare(self, query: RouteQuery) -> RouteQuery:
        """Pairs are chosen from the PD proxy's own text index, never by the policy, so
        the policy's preparation (kv_aware's tokenizing) would be wasted work."""
        return query

    def _select(self, query: RouteQuery, tried: set[str]) -> tuple[Worker, RoutingDecision] | None:
        now = self._clock()
        decodes = self._registry.accepting(now, "decode", exclude=tried)
        if not decodes:
            decodes = self._registry.accepting(now, "decode")
        if not decodes:
            return None
        prefills = self._registry.accepting(now, "prefill")
        self._index.maybe_trim(now)
        decode_tree = self._index.tree("decode", query.model)
        prefill_tree = self._index.tree("prefill", query.model)
        text_chars = max(1, len(query.text))
        decode_matched = decode_tree.match(query.text)
        prefill_matched = {w: c / text_chars for w, c in prefill_tree.match(query.text).items()}
        candidates = [
            DecodeCandidate(
                self._tracker.load(w.worker_id),
                self._free_fraction.get(w.worker_id, 1.0),
                decode_matched.get(w.worker_id, 0) / text_chars,
            )
            for w in decodes
        ]
        prefill_loads = [self._tracker.load(w.worker_id) for w in prefills]
        pair = choose_pair(
            candidates,
            prefill_loads,
            prefill_matched,
            query.prefill_tokens,
            self._pd_config,
            self._rotation,
        )
        decode_id = pair.decode.load.worker_id
        prefill_id = pair.prefill.worker_id if pair.prefill is not None else None
        decode_tree.insert(query.text, decode_id, now)
        if prefill_id is not None:
            prefill_tree.insert(query.text, prefill_id, now)
        decision = PairDecision(
            decode_id, "pd", pair.reason, pair.prefill_matched_fraction, prefill_id
        )
        self._metrics.record_decision(decision)
        worker = next(w for w in decodes if w.worker_id == decode_id)
        return worker, decision

    # -- the attempt -----------------------------------------------------------------

    def _acquire(self, worker: Worker, query: RouteQuery, decision: RoutingDecision) -> LoadGuard:
        prefill_id = _prefill_worker_id(decision)
        if prefill_id is None:  # the decode worker prefills: it carries the prefill tokens
            return self._tracker.acquire(worker.worker_id, query.prefill_tokens)
        prefill = self._tracker.acquire(prefill_id, query.prefill_tokens)
        return PairGuard(self._tracker.acquire(worker.worker_id, 0), prefill)  # type: ignore[return-value]

    def _upstream(
        self, request: web.Request, worker: Worker, decision: RoutingDecision
    ) -> tuple[str, dict[str, str]]:
        headers = self._upstream_headers(request)
        prefill_id = _prefill_worker_id(decision)
        prefill = self._registry.get(prefill_id) if prefill_id is not None else None
        if prefill is not None:
            headers[PREFILL_HEADER] = prefill.url
        return worker.url + "/pd" + request.path, headers

    def _served_by(
        self, decision: RoutingDecision, upstream: aiohttp.ClientResponse
    ) -> dict[str, str]:
        """The decode worker's word on how the prompt was prefilled, and the prefill worker
        when its KV was used (not when the decode worker fell back to prefilling itself)."""
        path = upstream.headers.get(PATH_HEADER)
        if path is None:
            return {}
        prefill_id = _prefill_worker_id(decision)
        if path == "remote" and prefill_id is not None:
            return {PATH_HEADER: path, PREFILL_WORKER_HEADER: prefill_id}
        return {PATH_HEADER: path}

    # -- decode headroom -------------------------------------------------------------

    async def poll_decode_loads_forever(self) -> None:
        """Keep each decode worker's KV headroom fresh: free plus cached blocks (cached
        ones are evictable unless a running request pins them) over all, from ``/load``."""
        timeout = aiohttp.ClientTimeout(total=self._config.health.timeout_s)
        while True:
            decodes = [w for w in self._registry.all() if w.pool == "decode"]
            await asyncio.gather(*(self._poll_load(w, timeout) for w in decodes))
            await asyncio.sleep(LOAD_POLL_INTERVAL_S)

    async def _poll_load(self, worker: Worker, timeout: aiohttp.ClientTimeout) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            async with self._session.get(worker.url + "/load", timeout=timeout) as response:
                load = await response.json()
            total = int(load["total_blocks"])
            reclaimable = int(load["free_blocks"]) + int(load["cached_blocks"])
            self._free_fraction[worker.worker_id] = reclaimable / total if total else 0.0

    def forget_worker(self, worker_id: str) -> None:
        """Drop the routing state of a worker that left the fleet."""
        self._index.forget_worker(worker_id)
        self._free_fraction.pop(worker_id, None)
