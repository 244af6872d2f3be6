"""The PD router's routing state per pool: prefill history never steers decode choices and
decode history never steers prefill choices; guards of both stages are released once."""

from __future__ import annotations

from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.routing.policies.cache_aware import CacheAwarePolicy
from kvserve.core.routing.types import PairDecision, RouteQuery
from kvserve.router.config import RouterConfig
from kvserve.router.load_guard import LoadTracker
from kvserve.router.metrics import RouterMetrics
from kvserve.router.pd_proxy import PDProxy
from kvserve.router.worker_registry import WorkerRegistry

PREFILL = ("http://p0", "http://p1")
DECODE = ("http://d0", "http://d1")


def make_proxy() -> tuple[PDProxy, LoadTracker, dict[str, str], CacheAwarePolicy]:
    config = RouterConfig(prefill_urls=PREFILL, decode_urls=DECODE, seed=0)
    registry = WorkerRegistry(config.circuit_breaker)
    pools = {}
    for pool, urls in (("prefill", PREFILL), ("decode", DECODE)):
        for url in urls:
            worker = registry.add(url, pool)
            worker.healthy = True
            pools[worker.worker_id] = pool
    tracker = LoadTracker()
    policy = config.make_policy(0.0)
    assert isinstance(policy, CacheAwarePolicy)
    proxy = PDProxy(
        config, registry, tracker, policy, RouterMetrics(), None, lambda: 0.0, pd_config=PDConfig()
    )
    return proxy, tracker, pools, policy


def query(text: str) -> RouteQuery:
    return RouteQuery(text=text, model="m", prefill_tokens=len(text) // 4)


def test_each_pool_learns_only_its_own_workers() -> None:
    proxy, _, pools, policy = make_proxy()
    texts = [f"conversation {i} " + "x" * 2000 for i in range(6)]
    for text in texts * 2:
        decode, decision = proxy._select(query(text), set())
        assert isinstance(decision, PairDecision) and pools[decode.worker_id] == "decode"
        assert decision.policy == "cache_aware"
        assert decision.prefill_worker_id is None or pools[decision.prefill_worker_id] == "prefill"
    for pool in ("prefill", "decode"):
        tree = policy.index.tree(pool, "m")
        for text in texts:
            tenants = set(tree.match(text))
            assert tenants and {pools[t] for t in tenants} == {pool}


def test_pair_guard_holds_both_workers_until_released_once() -> None:
    proxy, tracker, _, _ = make_proxy()
    worker, decision = proxy._select(query("y" * 4000), set())
    assert isinstance(decision, PairDecision) and decision.prefill_worker_id is not None
    guard = proxy._acquire(worker, query("y" * 4000), decision)
    prefill = tracker.load(decision.prefill_worker_id)
    assert (prefill.in_flight_requests, prefill.in_flight_prefill_tokens) == (1, 1000)
    assert tracker.load(worker.worker_id).in_flight_requests == 1
    guard.release_prefill()  # the first byte: prefill is over
    assert tracker.load(decision.prefill_worker_id).in_flight_requests == 0
    assert tracker.load(worker.worker_id).in_flight_requests == 1
    guard.release()
    guard.release()
    assert tracker.total_held().in_flight_requests == 0
    assert tracker.total_held().in_flight_prefill_tokens == 0
