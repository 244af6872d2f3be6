"""A streaming client that leaves in the same loop turn as the worker's answer ends (at
``[DONE]``) or begins: the relay ends quietly (no exception for the lean server to log as a
handler failure), nothing held, the answer counted as served or the client as gone.

The races are timing-dependent over real sockets (the first seen in a quarter of the
requests of a vLLM fleet benchmark, whose client closes at ``[DONE]``), so the transport
here turns closing exactly when ``[DONE]`` is written, or is closing from the start.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from multidict import CIMultiDict

from kvserve.core.routing.types import RouteQuery
from kvserve.router.config import RouterConfig
from kvserve.router.lean_request import LeanRequest
from kvserve.router.load_guard import LoadTracker
from kvserve.router.metrics import RouterMetrics
from kvserve.router.proxy import Proxy, _Attempt
from kvserve.router.worker_registry import WorkerRegistry

EVENTS = (b'data: {"choices": [{"text": " x"}]}\n\n', b"data: [DONE]\n\n")


class ClosingAt:
    """A client's transport that is closing once ``marker`` has been written to it (at
    once for an empty marker)."""

    def __init__(self, marker: bytes) -> None:
        self.written: list[bytes] = []
        self.closing = not marker
        self._marker = marker

    def write(self, data: bytes) -> None:
        self.written.append(data)
        self.closing = self.closing or self._marker in data

    def is_closing(self) -> bool:
        return self.closing


class FinishedStream:
    """A worker's streamed answer whose events have all arrived."""

    status = 200

    def __init__(self) -> None:
        self.content = self

    async def iter_any(self) -> AsyncIterator[bytes]:
        for event in EVENTS:
            yield event


def relay_to(transport: ClosingAt) -> tuple[LoadTracker, RouterMetrics, str]:
    """Relay FinishedStream to a client on ``transport`` as the proxy does, then end the
    attempt's guard as ``_attempt`` would; the tracker, metrics and worker id after."""
    config = RouterConfig(worker_urls=("http://127.0.0.1:9",), policy="round_robin", seed=0)
    registry = WorkerRegistry(config.circuit_breaker)
    registry.add("http://127.0.0.1:9").healthy = True
    tracker = LoadTracker()
    metrics = RouterMetrics()
    proxy = Proxy(config, registry, tracker, config.make_policy(0.0), metrics, None)  # type: ignore[arg-type]
    query = RouteQuery(text="x", model="m", prefill_tokens=1)
    selected = proxy._select(query, set())
    assert selected is not None
    chosen, decision = selected
    request = LeanRequest("/v1/completions", CIMultiDict(), b"{}", None, transport)  # type: ignore[arg-type]
    attempt = _Attempt(chosen, decision, query, tracker.acquire(chosen.worker_id, 1), 0.0, {})

    async def relay() -> None:
        await proxy._relay_stream(request, FinishedStream(), attempt)  # type: ignore[arg-type]

    asyncio.run(relay())  # a ConnectionResetError here reached the lean server's log
    attempt.guard.release()
    return tracker, metrics, chosen.worker_id


def test_client_leaving_at_done_ends_the_relay_quietly() -> None:
    transport = ClosingAt(b"[DONE]")
    tracker, metrics, worker_id = relay_to(transport)
    assert b"".join(transport.written).endswith(b"data: [DONE]\n\n\r\n")  # no end chunk
    assert tracker.total_held().in_flight_requests == 0
    assert metrics.worker(worker_id).requests(200).value == 1  # a whole answer
    assert metrics.errors.labels(worker_id, "client_gone").value == 0


def test_client_gone_as_the_answer_begins_is_counted_not_raised() -> None:
    transport = ClosingAt(b"")
    tracker, metrics, worker_id = relay_to(transport)
    assert transport.written == []
    assert tracker.total_held().in_flight_requests == 0
    assert metrics.worker(worker_id).requests(200).value == 0
    assert metrics.errors.labels(worker_id, "client_gone").value == 1
