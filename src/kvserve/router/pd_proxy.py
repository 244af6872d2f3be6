"""The router in prefill/decode mode: the pair chosen together, one request to the decode
worker, guards on both workers.

The router sends the client's body to the decode worker's ``/pd/v1/...`` with the chosen
prefill worker in ``x-kvserve-prefill`` (absent when the prefill is predicted local);
the decode worker reserves, pulls the KV from the prefill worker and streams the answer
back (see ``docs/internals.md``, PD protocol). The pair is the routing policy's
(``Policy.select_pair``: each policy's pair rule is in its module); the proxy gives it
the two pools' loads, each decode worker's KV headroom (polled from its ``/load``) and
the conditional-disaggregation thresholds. The decision header names the policy and the
prefill worker (``policy=kv_aware; ...; prefill=w0``, ``prefill=local`` when none).

Responses name the decode worker in ``x-kvserve-worker``, relay its ``x-kvserve-pd``
(``remote``, ``local``, ``fallback``) and, when the prefill worker's KV was used
(``remote``), name that worker in ``x-kvserve-prefill-worker``.

Guards: the prefill worker's (one request + the prompt's prefill tokens) is released when
the prefill worker is done, i.e. when the decode worker's response headers come: it sends
them only once the KV is installed (``remote``) or the transfer was given up
(``fallback``); at the latest it goes with the first token. The decode worker's (one
request) when the response ends. Both are released on every path through the base
proxy's ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from kvserve.core.routing.pd_pair import DECODE_POOL, PREFILL_POOL
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.types import PairDecision, RouteQuery, RoutingDecision
from kvserve.router.config import RouterConfig
from kvserve.router.lean_request import LeanRequest
from kvserve.router.load_guard import Guard, LoadGuard, LoadTracker
from kvserve.router.metrics import RouterMetrics
from kvserve.router.prompt_preparer import PromptPreparer
from kvserve.router.proxy import Proxy
from kvserve.router.upstream_client import UpstreamResponse
from kvserve.router.worker_registry import Worker, WorkerRegistry

PREFILL_HEADER = "x-kvserve-prefill"
PATH_HEADER = "x-kvserve-pd"  # the decode worker's answer: remote | local | fallback
PREFILL_WORKER_HEADER = "x-kvserve-prefill-worker"
LOAD_POLL_INTERVAL_S = 0.5


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
        """The first token came: the prefill worker's part is over, and so is any prefill
        work the decode worker did itself."""
        self.release_prefill_worker()
        self._decode.release_prefill()

    def release_prefill_worker(self) -> None:
        """The prefill worker's part is over (its KV is installed, or it was given up)."""
        if self._prefill is not None:
            self._prefill.release()

    def release(self) -> None:
        if self._prefill is not None:
            self._prefill.release()
        self._decode.release()


class PDProxy(Proxy):
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        tracker: LoadTracker,
        policy: Policy,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        clock: Callable[[], float] = time.monotonic,
        preparer: PromptPreparer | None = None,
        process: int | None = None,
    ) -> None:
        super().__init__(
            config, registry, tracker, policy, metrics, session, clock, preparer, process
        )
        self._free_fraction: dict[str, float] = {}  # decode worker -> free/total blocks

    # -- selection -------------------------------------------------------------------

    def _select(self, query: RouteQuery, tried: set[str]) -> tuple[Worker, RoutingDecision] | None:
        now = self._clock()
        decodes = self._registry.accepting(now, DECODE_POOL, exclude=tried)
        if not decodes:
            decodes = self._registry.accepting(now, DECODE_POOL)
        if not decodes:
            return None
        prefills = self._registry.accepting(now, PREFILL_POOL)
        decode_loads = [
            dataclasses.replace(
                self._tracker.load(w.worker_id),
                kv_free_fraction=self._free_fraction.get(w.worker_id, 1.0),
            )
            for w in decodes
        ]
        prefill_loads = [self._tracker.load(w.worker_id) for w in prefills]
        decision = self._policy.select_pair(
            query, decode_loads, prefill_loads, now, self._config.pd
        )
        self._metrics.record_decision(decision)
        worker = next(w for w in decodes if w.worker_id == decision.worker_id)
        return worker, decision

    # -- the attempt -----------------------------------------------------------------

    def _acquire(self, worker: Worker, query: RouteQuery, decision: RoutingDecision) -> Guard:
        prefill_id = _prefill_worker_id(decision)
        if prefill_id is None:  # the decode worker prefills: it carries the prefill tokens
            return self._tracker.acquire(worker.worker_id, query.prefill_tokens)
        prefill = self._tracker.acquire(prefill_id, query.prefill_tokens)
        return PairGuard(self._tracker.acquire(worker.worker_id, 0), prefill)

    def _upstream(
        self, request: web.Request | LeanRequest, worker: Worker, decision: RoutingDecision
    ) -> tuple[str, dict[str, str]]:
        headers = self._upstream_headers(request)
        prefill_id = _prefill_worker_id(decision)
        prefill = self._registry.get(prefill_id) if prefill_id is not None else None
        if prefill is not None:
            headers[PREFILL_HEADER] = prefill.url
        return worker.url + "/pd" + request.path, headers

    def _served_by(self, decision: RoutingDecision, upstream: UpstreamResponse) -> dict[str, str]:
        """The decode worker's word on how the prompt was prefilled, and the prefill worker
        when its KV was used (not when the decode worker fell back to prefilling itself)."""
        path = upstream.headers.get(PATH_HEADER)
        if path is None:
            return {}
        prefill_id = _prefill_worker_id(decision)
        if path == "remote" and prefill_id is not None:
            return {PATH_HEADER: path, PREFILL_WORKER_HEADER: prefill_id}
        return {PATH_HEADER: path}

    def _headers_arrived(self, guard: Guard, upstream: UpstreamResponse) -> None:
        """The decode worker answers only once it stopped waiting for the prefill worker."""
        if upstream.headers.get(PATH_HEADER) in ("remote", "fallback") and isinstance(
            guard, PairGuard
        ):
            guard.release_prefill_worker()

    # -- decode headroom -------------------------------------------------------------

    async def poll_decode_loads_forever(self) -> None:
        """Keep each decode worker's KV headroom fresh: free plus evictable blocks (cached
        ones no request pins) over all, from ``/load``."""
        timeout = aiohttp.ClientTimeout(total=self._config.health.timeout_s)
        while True:
            decodes = [w for w in self._registry.all() if w.pool == DECODE_POOL]
            await asyncio.gather(*(self._poll_load(w, timeout) for w in decodes))
            await asyncio.sleep(LOAD_POLL_INTERVAL_S)

    async def _poll_load(self, worker: Worker, timeout: aiohttp.ClientTimeout) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            async with self._session.get(worker.url + "/load", timeout=timeout) as response:
                load = await response.json()
            total = int(load["total_blocks"])
            reclaimable = int(load["free_blocks"]) + int(load["evictable_blocks"])
            self._free_fraction[worker.worker_id] = reclaimable / total if total else 0.0

    def forget_worker(self, worker_id: str) -> None:
        """Drop the headroom of a worker that left the fleet (the policy forgets the rest)."""
        self._free_fraction.pop(worker_id, None)
