"""Routing policies, one module each behind :class:`~kvserve.router.policies.base.Policy`."""

from __future__ import annotations

from random import Random

from kvserve.router.config import RouterConfig
from kvserve.router.policies.base import Policy
from kvserve.router.policies.cache_aware import CacheAwarePolicy
from kvserve.router.policies.kv_aware import KvAwarePolicy
from kvserve.router.policies.power_of_two import PowerOfTwoPolicy
from kvserve.router.policies.random import RandomPolicy
from kvserve.router.policies.round_robin import RoundRobinPolicy
from kvserve.router.policies.session import SessionPolicy


def make_policy(config: RouterConfig, now: float) -> Policy:
    """The policy named in ``config``, with its tuning."""
    rng = Random(config.seed)
    factories = {
        "cache_aware": lambda: CacheAwarePolicy(config.cache_aware, now),
        "round_robin": RoundRobinPolicy,
        "random": lambda: RandomPolicy(rng),
        "power_of_two": lambda: PowerOfTwoPolicy(rng),
        "session": lambda: SessionPolicy(config.session_virtual_nodes),
        "kv_aware": lambda: KvAwarePolicy(config.kv_aware, config.tokenizer),
    }
    return factories[config.policy]()


__all__ = ["Policy", "make_policy"]
