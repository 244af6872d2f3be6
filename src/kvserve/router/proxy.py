"""Forwarding one OpenAI request: prepare, select, guard, send, relay, retry, account.

Retries happen only before a byte has reached the client (a retryable status or an
unreachable worker), on a worker not tried yet when there is one. Streams are relayed as
the bytes arrive, never re-encoded. Every attempt's load guard is released in a
``finally``, so no exit path (including cancellation on client disconnect) leaks load;
an attempt that ends before its first token also has the policy take back what its
decision recorded (``Policy.undo``), before any retry selects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.types import RouteQuery, RoutingDecision, WorkerLoad
from kvserve.router.config import RouterConfig
from kvserve.router.errors import openai_error
from kvserve.router.kept_loads import KeptPoolLoads
from kvserve.router.lean_request import LeanRequest, RelayedAnswer
from kvserve.router.load_guard import Guard, LoadTracker
from kvserve.router.metrics import RouterMetrics
from kvserve.router.prompt_preparer import PromptPreparer
from kvserve.router.retry import RETRYABLE_STATUSES, backoff_delays
from kvserve.router.route_query import build_route_query
from kvserve.router.taken_out import AnswerWatch
from kvserve.router.upstream_client import UpstreamClient, UpstreamResponse
from kvserve.router.usage import StreamUsageReader, cached_tokens_in, is_error, json_body
from kvserve.router.worker_registry import Worker, WorkerRegistry

_FORWARDED_REQUEST_HEADERS = ("Accept", "X-Request-Id")
# Asks a worker to send a non-streamed answer's headers with its first token, and marks
# the answers that were (see ``kvserve.worker.generation``): prefill is over then.
FIRST_TOKEN_HEADER = "x-kvserve-first-token"
# Which of the router's processes answered (``--processes N`` > 1 only).
ROUTER_PROCESS_HEADER = "x-kvserve-router-process"

# Policies whose matched fraction is read from the workers' own KV events: what they
# predict cached is left out of the prefill work a guard holds. The approximate policies'
# matches are guesses from routing history, so their guards hold the whole prompt.
_EXACT_MATCH_POLICIES = frozenset({KvAwarePolicy.name})


@dataclass(slots=True)
class _Attempt:
    """One try of a request on one worker, and the load it holds there."""

    worker: Worker
    decision: RoutingDecision
    query: RouteQuery
    guard: Guard
    started: float
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class _RetryableFailure:
    """An attempt that failed before anything was sent to the client."""

    response: web.Response


class Proxy:
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
        kept_loads: KeptPoolLoads | None = None,
    ) -> None:
        self._config = config
        # each pool's loads kept between requests (None: listed per request; see
        # router/kept_loads.py for when a router can keep them)
        self._kept_loads = kept_loads
        # With --processes N, answers name the process that routed them (None: one).
        self._process = None if process is None else str(process)
        self._registry = registry
        self._tracker = tracker
        self._policy = policy
        self._metrics = metrics
        self._session = session
        self._clock = clock
        self._preparer = preparer
        self._rng = random.Random(config.seed)
        # Proxied requests go through the lean client; ``session`` serves the rest.
        self.upstream = UpstreamClient(config.worker_headers(), config.request_timeout_s)

    async def handle(
        self, request: web.Request | LeanRequest
    ) -> web.StreamResponse | RelayedAnswer:
        # Read (and bounded: 413) by the lean server, or by client_guard's middleware.
        raw = request.body if isinstance(request, LeanRequest) else await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return self._reject(400, "request body is not valid JSON", "invalid_json")
        if not isinstance(body, dict):
            return self._reject(400, "request body must be a JSON object", "invalid_json")
        query = build_route_query(
            body,
            request.headers,
            session_header=self._config.session_header,
            chars_per_token=self._config.chars_per_token,
        )
        if self._preparer is not None:
            # Once, before any guard: a client gone meanwhile leaves none held.
            query = await self._preparer.prepare(query)
        deferred = self._policy.decision_delay(self._clock())
        if deferred > 0:  # a router replica's turn in a burst, nothing held meanwhile
            await asyncio.sleep(deferred)
        delays: Iterator[float] | None = None  # made at the first retry: most need none
        tried: set[str] = set()
        while True:
            selected = self._select(query, tried)
            if selected is None:
                return self._reject(503, "no healthy worker is available", "no_worker")
            worker, decision = selected
            tried.add(worker.worker_id)
            outcome = await self._attempt(request, raw, query, worker, decision)
            if not isinstance(outcome, _RetryableFailure):
                return outcome
            if delays is None:
                delays = backoff_delays(self._config.retry, self._rng)
            delay = next(delays, None)
            if delay is None:
                return outcome.response
            self._metrics.retries.labels(worker.worker_id).inc()
            await asyncio.sleep(delay)

    def _select(self, query: RouteQuery, tried: set[str]) -> tuple[Worker, RoutingDecision] | None:
        now = self._clock()
        workers = self._registry.accepting(now, query.pool, exclude=tried)
        if not workers:  # every candidate failed once: retry among them rather than give up
            workers = self._registry.accepting(now, query.pool)
        if not workers:
            return None
        loads: Sequence[WorkerLoad]
        if self._kept_loads is not None and not tried:
            loads = self._kept_loads.of(query.pool, workers)
        else:  # a retry's pool less the workers tried: listed once
            loads = [self._tracker.load(w.worker_id) for w in workers]
        decision = self._policy.select(query, loads, now)
        self._metrics.record_decision(decision)
        chosen = self._registry.get(decision.worker_id)
        assert chosen is not None, "a policy chooses one of the workers it is given"
        return chosen, decision

    async def _attempt(
        self,
        request: web.Request | LeanRequest,
        raw: bytes,
        query: RouteQuery,
        worker: Worker,
        decision: RoutingDecision,
    ) -> web.StreamResponse | RelayedAnswer | _RetryableFailure:
        attempt = _Attempt(
            worker=worker,
            decision=decision,
            query=query,
            guard=self._acquire(worker, query, decision),
            started=self._clock(),
            headers={
                "x-kvserve-worker": worker.worker_id,
                "x-kvserve-decision": decision.header_value(),
            },
        )
        if self._process is not None:
            attempt.headers[ROUTER_PROCESS_HEADER] = self._process
        url, headers = self._upstream(request, worker, decision)
        try:
            with AnswerWatch(worker) as watch:
                async with self.upstream.post(url, data=raw, headers=headers) as upstream:
                    attempt.headers |= self._served_by(decision, upstream)
                    self._headers_arrived(attempt.guard, upstream)
                    first_token_sent = upstream.headers.get(FIRST_TOKEN_HEADER) == "1"
                    if first_token_sent:
                        self._first_byte(attempt)
                    if upstream.status == 401 and not self._passes_client_key:
                        await upstream.read()
                        return self._worker_refused_key(attempt)
                    if upstream.status in RETRYABLE_STATUSES:
                        self._record_failure(worker, f"status_{upstream.status}")
                        payload = await upstream.read()
                        return _RetryableFailure(
                            web.Response(
                                status=upstream.status, body=payload, headers=attempt.headers
                            )
                        )
                    attempt.headers["Content-Type"] = upstream.headers.get(
                        "Content-Type", "application/json"
                    )
                    if upstream.content_type == "text/event-stream":
                        watch.disarm()  # bytes reach the client from here: slow, maybe, not hung
                        return await self._relay_stream(request, upstream, attempt)
                    payload = await upstream.read()
                    answer = json_body(payload)
                    if first_token_sent and is_error(answer):
                        # The worker failed after its headers left: the status it could not send.
                        self._record_failure(worker, "status_503")
                        return _RetryableFailure(
                            web.Response(status=503, body=payload, headers=attempt.headers)
                        )
                    if not first_token_sent and upstream.status < 400:
                        # Its first byte and its last at once: the whole guard goes, in one change.
                        attempt.guard.release()
                        self._observe_ttft(attempt)
                    self._finish(attempt, upstream.status, cached_tokens_in(answer))
                    return RelayedAnswer(upstream.status, attempt.headers, payload)
        except TimeoutError:
            self._record_failure(worker, "timeout")
            return openai_error(
                504,
                "the worker did not answer in time",
                error_type="timeout",
                code="upstream_timeout",
                headers=attempt.headers,
            )
        except aiohttp.ClientError as error:
            self._record_failure(worker, "unreachable")
            return _RetryableFailure(
                openai_error(
                    502,
                    f"worker unreachable: {error}",
                    error_type="upstream_error",
                    code="worker_unreachable",
                    headers=attempt.headers,
                )
            )
        finally:
            if not attempt.guard.prefill_released:  # no first token: nothing computed there
                self._policy.undo(decision, self._clock())
            attempt.guard.release()

    def _acquire(self, worker: Worker, query: RouteQuery, decision: RoutingDecision) -> Guard:
        """The load this attempt holds until it ends (PD mode holds two workers')."""
        return self._tracker.acquire(worker.worker_id, guarded_prefill_tokens(query, decision))

    def _upstream(
        self, request: web.Request | LeanRequest, worker: Worker, decision: RoutingDecision
    ) -> tuple[str, dict[str, str]]:
        """Where the attempt goes and with which headers."""
        return worker.url + request.path, self._upstream_headers(request)

    def _served_by(self, decision: RoutingDecision, upstream: UpstreamResponse) -> dict[str, str]:
        """Response headers naming the workers that served the attempt, beyond
        ``x-kvserve-worker`` (PD mode adds the prefill worker's)."""
        return {}

    def _headers_arrived(self, guard: Guard, upstream: UpstreamResponse) -> None:
        """The worker's response headers came (PD mode: the prefill worker is done)."""

    async def _relay_stream(
        self, request: web.Request | LeanRequest, upstream: UpstreamResponse, attempt: _Attempt
    ) -> web.StreamResponse:
        """Relay SSE bytes as they come; from here on, nothing can be retried."""
        attempt.headers["Cache-Control"] = "no-cache"
        response = (
            request.stream_response(upstream.status, attempt.headers)
            if isinstance(request, LeanRequest)
            else web.StreamResponse(status=upstream.status, headers=attempt.headers)
        )
        try:
            await response.prepare(request)  # type: ignore[arg-type]  # lean: its own prepare
        except ConnectionResetError:  # the client left as the worker's answer began
            self._metrics.errors.labels(attempt.worker.worker_id, "client_gone").inc()
            return response
        usage = StreamUsageReader()
        try:
            async for chunk in upstream.content.iter_any():
                if not attempt.guard.prefill_released:
                    self._first_byte(attempt)
                usage.feed(chunk)
                try:
                    await response.write(chunk)
                except ConnectionResetError:
                    self._metrics.errors.labels(attempt.worker.worker_id, "client_gone").inc()
                    return response
        except (aiohttp.ClientError, TimeoutError) as error:
            kind = "timeout" if isinstance(error, TimeoutError) else "stream_broken"
            self._record_failure(attempt.worker, kind)
            await self._send_stream_error(response, f"worker stream ended early: {kind}")
            return response
        self._finish(attempt, upstream.status, usage.cached_tokens)
        # A client may leave once it reads the last event (``[DONE]``): it has the whole answer.
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    async def _send_stream_error(self, response: web.StreamResponse, message: str) -> None:
        event = {
            "error": {
                "message": message,
                "type": "upstream_error",
                "param": None,
                "code": "stream_broken",
            }
        }
        try:
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left as well

    def _first_byte(self, attempt: _Attempt) -> None:
        """Prefill is over on the worker: its prefill tokens no longer count as load."""
        attempt.guard.release_prefill()
        self._observe_ttft(attempt)

    def _observe_ttft(self, attempt: _Attempt) -> None:
        self._metrics.worker(attempt.worker.worker_id).ttft.observe(self._clock() - attempt.started)

    def _finish(self, attempt: _Attempt, status: int, reported_cached: int | None) -> None:
        figures = self._metrics.worker(attempt.worker.worker_id)
        figures.requests(status).inc()
        figures.e2e.observe(self._clock() - attempt.started)
        if status >= 500:
            attempt.worker.breaker.record_failure(self._clock())
            return
        attempt.worker.breaker.record_success()
        if status < 400:
            predicted = attempt.decision.matched_fraction * attempt.query.prefill_tokens
            figures.predicted_cached_tokens.inc(predicted)
            if reported_cached is not None:
                figures.reported_cached_tokens.inc(reported_cached)

    @property
    def _passes_client_key(self) -> bool:
        """A router with no keys of its own forwards the client's: the backend checks it."""
        return self._config.api_key is None and self._config.worker_api_key is None

    def _worker_refused_key(self, attempt: _Attempt) -> web.Response:
        """A 502 naming the router's configuration: the client's key was fine (or not
        needed), so the worker's 401 must not reach the client as if it were theirs. Not
        a worker failure either (the worker is healthy): its breaker stays as it is."""
        self._metrics.errors.labels(attempt.worker.worker_id, "worker_refused_key").inc()
        have = "its --worker-api-key" if self._config.worker_api_key else "no --worker-api-key"
        return openai_error(
            502,
            f"worker {attempt.worker.worker_id} refused the router's request ({have}):"
            " the router's --worker-api-key must be the workers' --api-key",
            error_type="upstream_error",
            code="worker_refused_key",
            headers=attempt.headers,
        )

    def _record_failure(self, worker: Worker, kind: str) -> None:
        self._metrics.errors.labels(worker.worker_id, kind).inc()
        worker.breaker.record_failure(self._clock())

    def _reject(self, status: int, message: str, code: str) -> web.Response:
        self._metrics.errors.labels("none", code).inc()
        error_type = "invalid_request_error" if status < 500 else "service_unavailable"
        return openai_error(status, message, error_type=error_type, code=code)

    def _upstream_headers(self, request: web.Request | LeanRequest) -> dict[str, str]:
        """The body parsed as JSON, so say so even when the client did not (``curl -d``)."""
        received = request.headers
        headers = {"Content-Type": "application/json"}
        for name in _FORWARDED_REQUEST_HEADERS:
            value = received.get(name)
            if value is not None:
                headers[name] = value
        headers[FIRST_TOKEN_HEADER] = "headers"  # a streamed request's first byte says it
        if self._passes_client_key and "Authorization" in received:
            headers["Authorization"] = received["Authorization"]  # the backend's key
        return headers  # else the session sends --worker-api-key, if any


def guarded_prefill_tokens(query: RouteQuery, decision: RoutingDecision) -> int:
    """The prefill work a request queues on its worker until its first token: the prompt
    estimate, less the part an exact-match policy predicts the worker holds already."""
    if decision.policy in _EXACT_MATCH_POLICIES:
        return decision.uncached_tokens(query.prefill_tokens)
    return query.prefill_tokens
