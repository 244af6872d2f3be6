"""The registry's kept accepting lists against a fresh scan of the fleet, after any
sequence of joins, leaves, health checks, breaker events and clock moves."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.router.config import CircuitBreakerConfig, HealthCheckConfig
from kvserve.router.worker_registry import WorkerRegistry

BREAKER = CircuitBreakerConfig(failure_threshold=2, success_threshold=2, open_s=5.0)
HEALTH = HealthCheckConfig(failure_threshold=2, success_threshold=2)
POOLS = ("regular", "prefill")

worker_index = st.integers(0, 7)
event = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(POOLS)),
    st.tuples(st.just("remove"), worker_index),
    st.tuples(st.just("health"), worker_index, st.booleans()),
    st.tuples(st.just("restart"), worker_index, st.integers(0, 2)),
    st.tuples(st.just("failure"), worker_index),
    st.tuples(st.just("success"), worker_index),
    st.tuples(st.just("set_healthy"), worker_index, st.sampled_from([True, False, None])),
    st.tuples(st.just("clock"), st.floats(0.0, 7.0)),
    st.tuples(st.just("ask"), st.sampled_from(POOLS), st.lists(worker_index, max_size=2)),
)


def fresh_scan(registry: WorkerRegistry, now: float, pool: str, exclude: set[str]) -> list[str]:
    return [
        w.worker_id
        for w in registry.all()
        if w.pool == pool and w.worker_id not in exclude and w.accepts_traffic(now)
    ]


@settings(max_examples=400, deadline=None)
@given(events=st.lists(event, max_size=60))
def test_kept_accepting_lists_equal_a_fresh_scan(events: list[tuple]) -> None:
    registry = WorkerRegistry(BREAKER)
    now = 0.0
    added = 0
    for kind, *args in events:
        workers = registry.all()
        targets_one = kind not in ("add", "clock", "ask")
        target = workers[args[0] % len(workers)] if workers and targets_one else None
        if kind == "add":
            registry.add(f"http://127.0.0.1:{9000 + added}", pool=args[0])
            added += 1
        elif kind == "clock":
            now += args[0]
        elif kind == "ask":
            names = [w.worker_id for w in workers]
            exclude = {names[i % len(names)] for i in args[1]} if names else set()
            kept = [w.worker_id for w in registry.accepting(now, args[0], exclude)]
            assert kept == fresh_scan(registry, now, args[0], exclude)
        elif target is None:
            continue
        elif kind == "remove":
            registry.remove(target.worker_id)
        elif kind == "health":
            target.record_health(args[1], HEALTH)
        elif kind == "restart":
            target.record_instance(f"process-{args[1]}")
        elif kind == "failure":
            target.breaker.record_failure(now)
        elif kind == "success":
            target.breaker.record_success()
        elif kind == "set_healthy":
            target.healthy = args[1]
    for pool in POOLS:
        kept = [w.worker_id for w in registry.accepting(now, pool)]
        assert kept == fresh_scan(registry, now, pool, set())


def test_an_open_breaker_readmits_its_worker_when_its_time_is_up_with_no_other_change() -> None:
    registry = WorkerRegistry(BREAKER)
    worker = registry.add("http://127.0.0.1:9000")
    worker.record_health(True, HEALTH)
    assert [w.worker_id for w in registry.accepting(0.0, "regular")] == ["w0"]
    worker.breaker.record_failure(1.0)
    worker.breaker.record_failure(1.0)
    assert not registry.accepting(5.9, "regular")
    assert [w.worker_id for w in registry.accepting(6.0, "regular")] == ["w0"]
