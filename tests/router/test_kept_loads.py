"""The router's loads kept per pool against the tracker read afresh, after any sequence of
guards taken and released, peers' announced loads, and workers joining, leaving and
changing health; and the proxy choosing from them."""

from __future__ import annotations

import dataclasses

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.routing.announcements import Announcement, LoadNote
from kvserve.core.routing.pool_loads import PoolLoads
from kvserve.core.routing.types import RouteQuery
from kvserve.router.app import Router
from kvserve.router.config import HealthCheckConfig, RouterConfig
from kvserve.router.load_guard import LoadGuard
from kvserve.router.metrics import RouterMetrics
from kvserve.router.proxy import Proxy

HEALTH = HealthCheckConfig(failure_threshold=1, success_threshold=1)
URLS = tuple(f"http://127.0.0.1:{9000 + n}" for n in range(4))

index = st.integers(0, 15)
step = st.one_of(
    st.tuples(st.just("acquire"), index, st.integers(0, 500)),
    st.tuples(st.just("first_token"), index),
    st.tuples(st.just("release"), index),
    st.tuples(st.just("peer"), index, st.integers(0, 3), st.integers(0, 500)),
    st.tuples(st.just("health"), index, st.booleans()),
    st.tuples(st.just("add"), st.just(0)),
    st.tuples(st.just("remove"), index),
    st.tuples(st.just("ask"), st.just(0)),
)


def router(peers: bool) -> Router:
    config = RouterConfig(worker_urls=URLS, policy="kv_aware", port=8123)
    if peers:
        config = dataclasses.replace(config, peer_urls=("http://127.0.0.1:8124",))
    made = Router(config)
    for worker in made.registry.all():
        worker.record_health(True, HEALTH)
    return made


def assert_kept_equals_fresh(made: Router) -> None:
    assert made.kept_loads is not None
    workers = made.registry.accepting(0.0, "regular")
    kept = made.kept_loads.of("regular", workers)
    fresh = [made.tracker.load(w.worker_id) for w in workers]
    assert list(kept) == fresh
    assert dict(kept.by_id) == {load.worker_id: load for load in fresh}


@settings(max_examples=300, deadline=None)
@given(peers=st.booleans(), steps=st.lists(step, max_size=50))
def test_kept_loads_equal_the_tracker_read_afresh(peers: bool, steps: list[tuple]) -> None:
    made = router(peers)
    guards: list[LoadGuard] = []
    added = len(URLS)
    for kind, *args in steps:
        workers = made.registry.all()
        target = workers[args[0] % len(workers)] if workers else None
        if kind == "ask":
            assert_kept_equals_fresh(made)
        elif kind == "add":
            made.registry.add(f"http://127.0.0.1:{9000 + added}").record_health(True, HEALTH)
            added += 1
        elif kind in ("first_token", "release"):
            if guards:
                guard = guards[args[0] % len(guards)]
                guard.release_prefill() if kind == "first_token" else guard.release()
        elif target is None:
            continue
        elif kind == "acquire":
            guards.append(made.tracker.acquire(target.worker_id, args[1]))
        elif kind == "peer" and made.peers is not None:
            note = LoadNote(target.url, args[1], args[2])
            made.peers.receive(orjson.dumps([Announcement("other", loads=(note,)).to_json()]))
        elif kind == "health":
            target.record_health(args[1], HEALTH)
        elif kind == "remove":
            made.registry.remove(target.worker_id)
    assert_kept_equals_fresh(made)


def test_the_proxy_chooses_from_the_kept_pool_and_follows_its_guards() -> None:
    made = router(peers=False)
    assert made.kept_loads is not None
    proxy = Proxy(
        made.config,
        made.registry,
        made.tracker,
        made.policy,
        RouterMetrics(),
        None,  # type: ignore[arg-type]  # no request is sent
        kept_loads=made.kept_loads,
    )
    query = RouteQuery(text="hello")  # no blocks: kv_aware takes the least loaded
    chosen = []
    for _ in range(len(URLS)):
        selected = proxy._select(query, set())
        assert selected is not None
        worker, _ = selected
        chosen.append(worker.worker_id)
        made.tracker.acquire(worker.worker_id, 100)
    assert sorted(chosen) == sorted(w.worker_id for w in made.registry.all())
    pool = made.kept_loads.of("regular", made.registry.accepting(0.0, "regular"))
    assert isinstance(pool, PoolLoads)
    assert [load.in_flight_requests for load in pool] == [1] * len(URLS)
