"""Router replicas in the simulator: own guards each, the same events, reports between."""

from __future__ import annotations

import dataclasses

from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.types import WorkerLoad
from kvserve.sim.replicas import RouterReplica
from kvserve.sim.report import summarize
from kvserve.sim.simulator import Simulation, simulate
from tests.sim.test_simulator import config, conversations


def test_a_replica_sees_its_own_guards_now_and_the_others_as_last_reported() -> None:
    replica = RouterReplica(KvAwarePolicy(KvAwareConfig()), ["w0", "w1"])
    replica.adjust("w0", 1, 100)
    replica.learn_report("w0", 3, 700)  # all replicas: 2 requests and 600 tokens are others'
    replica.adjust("w0", 1, 50)
    replica.adjust("w0", 0, -100)
    assert replica.snapshot() == [
        WorkerLoad("w0", 4, 50, others_prefill_tokens=600),
        WorkerLoad("w1"),
    ]


def test_replicas_share_the_fleet_and_release_every_guard() -> None:
    trace = conversations(num=20, turns=3, gap_s=0.5, seed=5)
    for interval in (None, 0.05, 0.0):
        simulation = Simulation(
            "kv_aware",
            dataclasses.replace(config(), router_replicas=3, load_report_interval_s=interval),
        )
        result = simulation.run(trace)
        assert len(result.records) == len(trace)
        for replica in simulation.replicas:
            assert set(replica.requests.values()) == {0}
            assert set(replica.prefill_tokens.values()) == {0}


def test_replicas_fed_the_same_events_find_conversations_as_one_router_does() -> None:
    trace = conversations(num=13, turns=4, gap_s=5.0)
    one = summarize(simulate(trace, "kv_aware", config())).hit_rate
    four = summarize(
        simulate(trace, "kv_aware", dataclasses.replace(config(), router_replicas=4))
    ).hit_rate
    assert four == one
