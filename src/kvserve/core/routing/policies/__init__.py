"""Routing policies, one module each behind :class:`~kvserve.core.routing.policy.Policy`,
built by name alike for the router and the simulator."""

from __future__ import annotations

from collections.abc import Callable
from random import Random

from kvserve.core.routing.cache_aware import CacheAwareConfig
from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.policies.cache_aware import CacheAwarePolicy
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.policies.least_loaded import LeastLoadedPolicy
from kvserve.core.routing.policies.power_of_two import PowerOfTwoPolicy
from kvserve.core.routing.policies.random import RandomPolicy
from kvserve.core.routing.policies.round_robin import RoundRobinPolicy
from kvserve.core.routing.policies.session import SessionPolicy
from kvserve.core.routing.policy import Policy

POLICY_NAMES = (
    "cache_aware",
    "kv_aware",
    "round_robin",
    "random",
    "power_of_two",
    "session",
    "least_loaded",
)


def make_policy(
    name: str,
    now: float,
    *,
    seed: int | None = None,
    cache_aware: CacheAwareConfig | None = None,
    kv_aware: KvAwareConfig | None = None,
    session_virtual_nodes: int = 160,
) -> Policy:
    """The policy called ``name`` with its tuning; ``seed`` seeds the random ones (None:
    from the OS)."""
    factories: dict[str, Callable[[], Policy]] = {
        "cache_aware": lambda: CacheAwarePolicy(cache_aware or CacheAwareConfig(), now),
        "kv_aware": lambda: KvAwarePolicy(kv_aware or KvAwareConfig()),
        "round_robin": RoundRobinPolicy,
        "random": lambda: RandomPolicy(Random(seed)),
        "power_of_two": lambda: PowerOfTwoPolicy(Random(seed)),
        "session": lambda: SessionPolicy(session_virtual_nodes),
        "least_loaded": LeastLoadedPolicy,
    }
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; choose from {POLICY_NAMES}")
    return factories[name]()


__all__ = ["POLICY_NAMES", "Policy", "make_policy"]
