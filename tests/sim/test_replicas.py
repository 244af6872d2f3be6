"""Router replicas in the simulator: own guards each, the same events, reports between."""

from __future__ import annotations

import dataclasses

from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.types import WorkerLoad
from kvserve.sim.replicas import RouterReplica
from kvserve.sim.report import summarize
from kvserve.sim.simulator import SimConfig, Simulation, simulate
from kvserve.sim.trace import TraceRequest
from tests.sim.test_simulator import config, conversations


def unsalted(sim_config: SimConfig) -> SimConfig:
    """Replicas that rank workers exactly as one router does, each deciding as its
    requests arrive (no replica salt, no stagger)."""
    kv_aware = dataclasses.replace(sim_config.kv_aware, replica_spread_s=0.0, replica_stagger_s=0.0)
    return dataclasses.replace(sim_config, kv_aware=kv_aware)


def salted(sim_config: SimConfig) -> SimConfig:
    """Replicas that salt their scores (50 ms, the default before the stagger) and
    decide as their requests arrive."""
    kv_aware = dataclasses.replace(
        sim_config.kv_aware, replica_spread_s=0.05, replica_stagger_s=0.0
    )
    return dataclasses.replace(sim_config, kv_aware=kv_aware)


def test_a_replica_sees_its_own_guards_now_and_the_others_as_last_reported() -> None:
    replica = RouterReplica(KvAwarePolicy(KvAwareConfig()), ["w0", "w1"])
    replica.adjust("w0", 1, 100)
    replica.learn_report("w0", 3, 700)  # all replicas: 2 requests and 600 tokens are others'
    replica.adjust("w0", 1, 50)
    replica.adjust("w0", 0, -100)
    assert list(replica.snapshot()) == [
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
    """Unsalted: the default salt (50 ms) outweighs these short prompts' hits (a hit
    here saves under 2,000 tokens' prefill), see docs/internals.md."""
    trace = conversations(num=13, turns=4, gap_s=5.0)
    one = summarize(simulate(trace, "kv_aware", config())).hit_rate
    four = summarize(
        simulate(trace, "kv_aware", dataclasses.replace(unsalted(config()), router_replicas=4))
    ).hit_rate
    assert four == one


def test_replicas_announcing_at_once_route_exactly_as_one_router() -> None:
    trace = conversations(num=30, turns=4, gap_s=0.05, seed=3)
    one = simulate(trace, "kv_aware", config())
    four = Simulation(
        "kv_aware",
        dataclasses.replace(unsalted(config()), router_replicas=4, announce_delay_s=0.0),
    )
    result = four.run(trace)
    assert [r.worker_id for r in result.records] == [r.worker_id for r in one.records]
    assert [r.first_token_s for r in result.records] == [r.first_token_s for r in one.records]
    for replica in four.replicas:  # every guard released, every peer's load announced back
        assert set(replica.requests.values()) == {0}
        assert all(replica.peers.load(w) == (0, 0) for w in replica.requests)
    silent = simulate(trace, "kv_aware", dataclasses.replace(salted(config()), router_replicas=4))
    assert [r.worker_id for r in silent.records] != [r.worker_id for r in one.records]


def test_a_replica_counts_its_peers_announced_load() -> None:
    a = RouterReplica(KvAwarePolicy(KvAwareConfig()), ["w0", "w1"], "a", announce=True)
    b = RouterReplica(KvAwarePolicy(KvAwareConfig()), ["w0", "w1"], "b", announce=True)
    a.adjust("w1", 1, 300)
    announcement = a.announcement()
    assert announcement is not None
    b.deliver(announcement, 0.0)
    assert list(b.snapshot()) == [WorkerLoad("w0"), WorkerLoad("w1", 1, 300)]
    assert b.announcement() is None  # nothing of its own to tell


def test_one_router_is_untouched_by_the_replica_salt_and_stagger() -> None:
    trace = in_buckets(conversations(num=30, turns=4, gap_s=0.05, seed=3), 0.05)
    kv_aware = dataclasses.replace(config().kv_aware, replica_spread_s=0.05)
    both = simulate(trace, "kv_aware", dataclasses.replace(config(), kv_aware=kv_aware))
    assert kv_aware.replica_stagger_s > 0
    plain = simulate(trace, "kv_aware", unsalted(config()))
    assert both.records == plain.records


def in_buckets(trace: list[TraceRequest], bucket_s: float) -> list[TraceRequest]:
    """``trace`` with each arrival stamped down to a multiple of ``bucket_s`` (as the
    Mooncake traces stamp theirs): bursts of requests at one instant."""
    return [dataclasses.replace(r, arrival_s=r.arrival_s // bucket_s * bucket_s) for r in trace]


def test_simulated_replicas_salt_their_choices_by_name_in_bursts() -> None:
    trace = in_buckets(conversations(num=30, turns=4, gap_s=0.05, seed=3), 0.05)
    at_once = dataclasses.replace(salted(config()), router_replicas=4, announce_delay_s=0.0)
    salting = Simulation("kv_aware", at_once)
    names = []
    for replica in salting.replicas:
        assert isinstance(replica.policy, KvAwarePolicy)
        salt = replica.policy.routing.salt
        names.append(None if salt is None else salt.replica)
    assert names == ["r0", "r1", "r2", "r3"]
    plain = simulate(trace, "kv_aware", unsalted(at_once))
    assert [r.worker_id for r in salting.run(trace).records] != [r.worker_id for r in plain.records]


def test_simulated_replicas_leave_spread_arrivals_unsalted() -> None:
    """Arrivals ~17 ms apart over the fleet (its replicas' own and announced ones, well
    over the 2 ms burst window): every choice is the unsalted one; with no window (every
    decision salted) they differ."""
    trace = conversations(num=30, turns=4, gap_s=0.5, seed=3)
    at_once = dataclasses.replace(salted(config()), router_replicas=4, announce_delay_s=0.0)
    plain = [r.worker_id for r in simulate(trace, "kv_aware", unsalted(at_once)).records]
    gated = simulate(trace, "kv_aware", at_once)
    assert [r.worker_id for r in gated.records] == plain
    always = dataclasses.replace(at_once.kv_aware, replica_burst_window_s=0.0)
    every = simulate(trace, "kv_aware", dataclasses.replace(at_once, kv_aware=always))
    assert [r.worker_id for r in every.records] != plain


def cold_burst(num: int) -> list[TraceRequest]:
    """``num`` requests at one instant, no two sharing a block."""
    return [
        TraceRequest(f"b{i}", 0.0, 64 * 16, 4, tuple(range(1000 * i, 1000 * i + 64)))
        for i in range(num)
    ]


def test_replicas_taking_turns_spread_a_burst_as_one_router_does() -> None:
    """12 cold requests at one instant over 4 replicas and 12 idle workers: one router
    gives each its own worker; replicas deciding at once, blind to each other's share,
    send some to the same worker; replicas deferring by rank (each after the lower
    ranks' announcements) give each its own worker again, and their requests' TTFT
    counts the wait from arrival."""
    trace = cold_burst(12)
    fleet = dataclasses.replace(config(), num_workers=12)
    one = simulate(trace, "kv_aware", fleet)
    assert len({r.worker_id for r in one.records}) == 12
    every = dataclasses.replace(fleet.kv_aware, replica_burst_window_s=0.0)
    replicas = dataclasses.replace(
        fleet, kv_aware=every, router_replicas=4, announce_delay_s=0.0005
    )
    blind = simulate(trace, "kv_aware", unsalted(replicas))
    assert len({r.worker_id for r in blind.records}) < 12
    turns = simulate(trace, "kv_aware", replicas)
    assert len({r.worker_id for r in turns.records}) == 12
    assert {r.arrival_s for r in turns.records} == {0.0}
    stagger = every.replica_stagger_s
    slowest = max(r.first_token_s or 0.0 for r in turns.records)
    assert slowest >= max(r.first_token_s or 0.0 for r in one.records) + 3 * stagger - 1e-9


def test_replicas_take_turns_only_in_bursts() -> None:
    """Arrivals ~17 ms apart: no replica defers (every choice as replicas deciding at
    once make it); in same-instant buckets they do."""
    trace = conversations(num=30, turns=4, gap_s=0.5, seed=3)
    replicas = dataclasses.replace(config(), router_replicas=4, announce_delay_s=0.0005)
    gated = simulate(trace, "kv_aware", replicas)
    plain = simulate(trace, "kv_aware", unsalted(replicas))
    assert gated.records == plain.records
    bursts = in_buckets(trace, 0.5)
    assert (
        simulate(bursts, "kv_aware", replicas).records
        != simulate(bursts, "kv_aware", unsalted(replicas)).records
    )
