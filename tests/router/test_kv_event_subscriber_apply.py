"""The subscriber hands the policy each answer's events in order and never one past a gap:
those after it wait for the resync from a snapshot."""

from __future__ import annotations

import pytest

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.router.config import CircuitBreakerConfig
from kvserve.router.kv_event_subscriber import KVEventSubscriber, _Resync
from kvserve.router.worker_registry import WorkerRegistry
from kvserve.worker.events import event_body


def stored(seq: int, block_hash: int) -> dict[str, object]:
    return event_body(KVEvent(seq, "stored", "device", (block_hash,), None))


def test_events_after_a_gap_are_not_applied() -> None:
    registry = WorkerRegistry(CircuitBreakerConfig())
    worker_id = registry.add("http://worker.test").worker_id
    policy = KvAwarePolicy(KvAwareConfig())
    subscriber = KVEventSubscriber(policy, registry, None)
    snapshot = {"tier": "device", "blocks": [[7, None]], "tiers": {"host": [[8, None]]}}
    subscriber.apply_snapshot(worker_id, {**snapshot, "last_seq": 3})
    index = policy.routing.index
    assert index.holds(worker_id, 7) and index.holds(worker_id, 8, "host")

    subscriber.apply_events(worker_id, [stored(4, 40), stored(5, 50)])
    assert subscriber.last_seq[worker_id] == 5
    with pytest.raises(_Resync):
        subscriber.apply_events(worker_id, [stored(6, 60), stored(8, 80)])
    assert subscriber.last_seq[worker_id] == 6
    assert [index.holds(worker_id, h) for h in (40, 50, 60, 80)] == [True, True, True, False]
