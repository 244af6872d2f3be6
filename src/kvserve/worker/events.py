"""The worker's KV events over HTTP: a long-polled ordered stream and a snapshot.

A subscriber (the router's ``kv_aware`` policy) keeps the sequence number of the last
event it applied and asks for what came after it; the request waits until there is
something or the timeout passes, so following the stream costs one open request, not a
busy poll. If the subscriber fell behind the bounded history (or the worker restarted),
the answer is a 410 and it resynchronises from ``/kv/snapshot``. Wire format:
docs/internals.md, "Worker KV events API".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Query
from starlette.responses import Response

from kvserve.core.kv_events import EventGapError, KVEvent
from kvserve.worker.engine_bridge import EngineBridge
from kvserve.worker.errors import APIError
from kvserve.worker.json_response import JSONResponse

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

_MAX_WAIT_S = 60.0
BlockList = Sequence[tuple[int, int | None]]  # (hash, parent_hash), parents first


def event_body(event: KVEvent) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "kind": event.kind,
        "tier": event.tier,
        "block_hashes": list(event.block_hashes),
        "parent_hash": event.parent_hash,
    }


def _take_snapshot(
    engine: LLMEngine,
) -> tuple[int, BlockList, Mapping[str, BlockList], str | None]:
    """Every tier at one ``last_seq``: run on the engine thread, where every tier's
    events are emitted, so no event falls between the device and the other tiers. With
    them, the name of the store the storage tier shares with other workers."""
    last_seq, device = engine.kv_cache.snapshot()
    return last_seq, device, engine.connector_snapshot(), engine.shared_store()


def _pairs(blocks: BlockList) -> list[list[int | None]]:
    return [[block_hash, parent] for block_hash, parent in blocks]


def build_events_router(bridge: EngineBridge, block_size: int) -> APIRouter:
    router = APIRouter(prefix="/kv")

    @router.get("/events")
    async def kv_events(
        after: int = Query(0, ge=0, le=2**63 - 1),
        timeout: float = Query(0.0, ge=0.0, le=_MAX_WAIT_S),
    ) -> Response:
        if bridge.state.events_last_seq == after:
            await bridge.wait_for_events(after, timeout)
            if bridge.state.events_last_seq == after:
                return JSONResponse({"last_seq": after, "events": []})
        try:
            events = await bridge.call(lambda e: e.events.since(after))
        except EventGapError as exc:
            raise APIError(410, str(exc), param="after", code="kv_events_gap") from exc
        last_seq = events[-1].seq if events else after
        return JSONResponse({"last_seq": last_seq, "events": [event_body(e) for e in events]})

    @router.get("/snapshot")
    async def kv_snapshot() -> Response:
        last_seq, device, below, store = await bridge.call(_take_snapshot)
        body: dict[str, Any] = {
            "last_seq": last_seq,
            "tier": "device",
            "block_size": block_size,
            "blocks": _pairs(device),
            "tiers": {tier: _pairs(blocks) for tier, blocks in below.items()},
        }
        if store is not None:
            body["storage_id"] = store
        return JSONResponse(body)

    return router
