"""A replica's salt applies only while its own requests arrive in bursts."""

from __future__ import annotations

import pytest

from kvserve.core.routing.announcements import ChoiceNote
from kvserve.core.routing.arrival_bursts import RECENT_GAPS, ArrivalBursts
from kvserve.core.routing.kv_aware import KvAwareConfig, KvAwareRouting
from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.tie_breaking import ReplicaSalt
from kvserve.core.routing.types import PromptBlocks, RouteQuery, WorkerLoad

BLOCK = 16
WINDOW = 0.002
REPLICAS = [f"r{i}" for i in range(8)]


def test_no_burst_before_a_second_arrival_nor_with_gaps_over_the_window() -> None:
    bursts = ArrivalBursts(WINDOW)
    assert not bursts.bursting
    bursts.arrived(1.0)
    assert not bursts.bursting
    for n in range(1, 20):
        bursts.arrived(1.0 + n * 0.01)
        assert not bursts.bursting


def test_a_burst_is_half_of_the_recent_gaps_under_the_window() -> None:
    bursts = ArrivalBursts(WINDOW)
    times = [0.0, 0.0, 0.5, 0.5]  # gaps: short, long, short
    for t in times:
        bursts.arrived(t)
    assert bursts.bursting
    bursts.arrived(1.0)  # 2 short of 4
    assert bursts.bursting
    bursts.arrived(1.5)  # 2 of 5
    assert not bursts.bursting


def test_only_the_last_gaps_count() -> None:
    bursts = ArrivalBursts(WINDOW)
    now = 0.0
    for _ in range(RECENT_GAPS + 1):  # a burst ...
        bursts.arrived(now)
    assert bursts.bursting
    for _ in range(RECENT_GAPS // 2 + 1):  # ... then a stream: over half of the last gaps long
        now += 1.0
        bursts.arrived(now)
    assert not bursts.bursting


def test_a_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        ArrivalBursts(-1.0)
    with pytest.raises(ValueError, match="replica_burst_window_s"):
        KvAwareConfig(replica_burst_window_s=-0.01)


def choose_on_idle_pair(name: str, arrivals: list[float]) -> str:
    """A replica's choice between two idle workers (a tie: only its salt breaks it
    its own way) after requests arrived at ``arrivals``."""
    routing = KvAwareRouting(KvAwareConfig(replica_spread_s=0.02, replica_burst_window_s=WINDOW))
    routing.as_replica(name, 0)
    for now in arrivals:
        routing.arrived(now)
    loads = [WorkerLoad("w0"), WorkerLoad("w1")]
    return routing.best(loads, [7, 8, 9], 3 * BLOCK, BLOCK, now=arrivals[-1]).worker_id


def test_replicas_split_a_tie_by_their_salt_in_a_burst_only() -> None:
    lone = KvAwareRouting(KvAwareConfig())
    unsalted = lone.best([WorkerLoad("w0"), WorkerLoad("w1")], [7, 8, 9], 3 * BLOCK, BLOCK, 0.0)
    in_burst = {name: choose_on_idle_pair(name, [0.0, 0.0, 0.001]) for name in REPLICAS}
    for name, worker_id in in_burst.items():
        assert worker_id == min(("w0", "w1"), key=ReplicaSalt(name, 0.02))
    assert set(in_burst.values()) == {"w0", "w1"}
    spread = {choose_on_idle_pair(name, [0.0, 0.1, 0.2]) for name in REPLICAS}
    assert spread == {unsalted.worker_id}


def test_a_policy_counts_each_request_once_a_pair_too() -> None:
    """Requests a second apart are no burst, though a remote PD pair asks for two
    choices at one instant (decode, then prefill): one arrival per request."""
    policy = KvAwarePolicy(KvAwareConfig(replica_burst_window_s=WINDOW))
    policy.as_replica("r1", 1)  # a rank that takes turns: the gate is kept
    bursts = policy.routing.bursts
    assert bursts is not None
    workers = [WorkerLoad("d0"), WorkerLoad("d1")]
    prefills = [WorkerLoad("p0"), WorkerLoad("p1")]
    for n in range(4):  # 320 new tokens each: a remote prefill
        hashes = [1000 * n + b for b in range(1, 21)]
        query = RouteQuery("", blocks=PromptBlocks(20 * BLOCK + 5, hashes, BLOCK))
        pair = policy.select_pair(query, workers, prefills, float(n), PDConfig())
        assert pair.prefill_worker_id is not None
        assert not bursts.bursting
    for _ in range(5):  # five requests at one instant: half of the last 8 gaps short
        policy.select(query, workers, now=10.0)
    assert bursts.bursting


def test_peers_choices_count_as_arrivals_a_pairs_decode_side_not() -> None:
    """A burst split over the replicas: each gets one request of it, a long gap after
    its last, but hears its peers' shares of the burst announced."""
    policy = KvAwarePolicy(KvAwareConfig(replica_burst_window_s=WINDOW))
    policy.as_replica("r1", 1)  # a rank that takes turns: the gate is kept
    bursts = policy.routing.bursts
    assert bursts is not None
    workers = [WorkerLoad("w0"), WorkerLoad("w1")]
    for n in range(4):  # its own requests, a second apart: no burst
        query = RouteQuery("", blocks=PromptBlocks(3 * BLOCK, [n * 10 + 1], BLOCK))
        policy.select(query, workers, now=float(n))
    seq = 0
    for _ in range(8):  # a pair's decode side, announced at one instant: not requests
        seq += 1
        policy.observe_peer_choice(ChoiceNote(seq, "w1", (5,), BLOCK, 0, computes=False), 3.0)
    assert not bursts.bursting
    for _ in range(4):  # the peers' shares of a burst, announced at one instant
        seq += 1
        policy.observe_peer_choice(ChoiceNote(seq, "w1", (5,), BLOCK, 0), 3.0005)
    assert bursts.bursting


def test_a_replica_defers_by_its_rank_in_bursts_only() -> None:
    """Rank r waits r staggers from a request's arrival while arrivals come in bursts;
    rank 0, a stream spread in time, and a stagger of 0 wait for nothing."""
    stagger = 0.001
    config = KvAwareConfig(replica_stagger_s=stagger, replica_burst_window_s=WINDOW)
    ranks = [KvAwareRouting(config) for _ in range(3)]
    for rank, routing in enumerate(ranks):
        routing.as_replica(f"r{rank}", rank)
        for now in (0.0, 0.5, 1.0):  # spread: no burst
            routing.arrived(now)
        assert routing.decision_delay(1.0) == 0.0
        for _ in range(8):  # eight at one instant: a burst
            routing.arrived(2.0)
        assert routing.decision_delay(2.0) == rank * stagger
    still = KvAwareRouting(KvAwareConfig(replica_stagger_s=0.0))
    still.as_replica("r2", 2)
    assert still.bursts is None and still.decision_delay(0.0) == 0.0
    always = KvAwareRouting(KvAwareConfig(replica_stagger_s=stagger, replica_burst_window_s=0))
    always.as_replica("r2", 2)
    assert always.decision_delay(0.0) == 2 * stagger
    with pytest.raises(ValueError, match="replica_stagger_s"):
        KvAwareConfig(replica_stagger_s=-0.001)


def test_a_lone_router_never_defers() -> None:
    policy = KvAwarePolicy(KvAwareConfig(replica_burst_window_s=0))
    assert policy.decision_delay(0.0) == 0.0
