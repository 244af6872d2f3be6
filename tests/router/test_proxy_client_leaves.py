"""A streaming client that leaves as soon as it reads the last event (``[DONE]``), in the
same loop turn as the worker ends its stream: the relay ends quietly (no exception for the
lean server to log as a handler failure), the answer counted as served, nothing held.

The race is timing-dependent over real sockets (seen in a quarter of the requests of a
vLLM fleet benchmark, whose client closes at ``[DONE]``), so the transport here turns
closing exactly when ``[DONE]`` is written.
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


class ClosingAtDone:
    """A client's transport that is closing once ``[DONE]`` has been written to it."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)
        self.closing = self.closing or b"[DONE]" in data

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


def test_client_leaving_at_done_ends_the_relay_quietly() -> None:
    config = RouterConfig(worker_urls=("http://127.0.0.1:9",), policy="round_robin", seed=0)
    registry = WorkerRegistry(config.circuit_breaker)
    worker = registry.add("http://127.0.0.1:9")
    worker.healthy = True
    tracker = LoadTracker()
    policy = config.make_policy(0.0)
    metrics = RouterMetrics()
    proxy = Proxy(config, registry, tracker, policy, metrics, None, lambda: 0.0)  # type: ignore[arg-type]
    query = RouteQuery(text="x", model="m", prefill_tokens=1)
    selected = proxy._select(query, set())
    assert selected is not None
    chosen, decision = selected
    transport = ClosingAtDone()
    request = LeanRequest("/v1/completions", CIMultiDict(), b"{}", None, transport)  # type: ignore[arg-type]
    guard = tracker.acquire(chosen.worker_id, 1)
    attempt = _Attempt(chosen, decision, query, guard, 0.0, {})

    async def relay() -> None:
        await proxy._relay_stream(request, FinishedStream(), attempt)  # type: ignore[arg-type]

    asyncio.run(relay())  # raised ConnectionResetError from write_eof before the fix
    guard.release()
    assert b"".join(transport.written).endswith(b"data: [DONE]\n\n\r\n")  # no end chunk sent
    assert tracker.total_held().in_flight_requests == 0
    served = metrics.worker(chosen.worker_id).requests(200)
    assert served.value == 1  # counted as a whole answer
