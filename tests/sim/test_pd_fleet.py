"""Prefill/decode fleets in the simulator: the router's pair rule, the decode worker's
reservation, transfers timed by the transfer model, guards released as the router does."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvserve.sim.report import summarize
from kvserve.sim.simulator import SimConfig, Simulation, simulate
from kvserve.sim.trace import BLOCK_TOKENS, TraceRequest
from tests.sim.test_simulator import conversations, run_simulate

TINY_KV_BYTES = 1_000_000  # the tiny profile's K/V per token


def pd_config(prefill: int = 2, decode: int = 2, cache_blocks: int = 64, **kw) -> SimConfig:
    from tests.sim.test_simulator import config

    base = config(workers=prefill + decode, cache_blocks=cache_blocks)
    return dataclasses.replace(base, prefill_workers=prefill, **kw)


@pytest.mark.parametrize("policy", ["cache_aware", "kv_aware", "round_robin"])
def test_every_request_is_served_once_and_every_guard_comes_back(policy: str) -> None:
    trace = conversations(num=12, turns=3, gap_s=1.0, seed=5)
    sim = Simulation(policy, pd_config())
    result = sim.run(trace)
    assert result.unfinished == 0
    assert sorted(r.arrival_s for r in result.records) == sorted(r.arrival_s for r in trace)
    replica = sim.replicas[0]
    assert set(replica.requests.values()) == {0}
    assert set(replica.prefill_tokens.values()) == {0}
    assert result.prefill_workers == ("p0", "p1")
    assert {r.worker_id for r in result.records} <= {"d0", "d1"}
    remote = [r for r in result.records if r.prefill_worker_id is not None]
    assert remote and {r.prefill_worker_id for r in remote} <= {"p0", "p1"}
    for worker in sim.workers.values():  # no lease or request left holding blocks
        assert worker.kv_cache.num_available_blocks == worker.kv_cache.num_blocks
        worker.kv_cache.check()


def test_a_transfer_takes_the_models_time_and_delays_the_first_token() -> None:
    trace = conversations(num=1, turns=1, gap_s=1.0)  # 2 blocks, none cached anywhere
    fast = simulate(trace, "cache_aware", pd_config(1, 1, transfer_gbps=1000.0))
    slow = simulate(trace, "cache_aware", pd_config(1, 1, transfer_gbps=1.0))
    [quick], [late] = fast.records, slow.records
    assert late.prefill_worker_id == "p0" and late.transfer_s is not None
    # one full block before the last token travels: 512 tokens of 1 MB each
    assert late.transfer_s == pytest.approx(1e-3 + BLOCK_TOKENS * TINY_KV_BYTES / 1e9)
    assert quick.first_token_s is not None and late.first_token_s is not None
    delay = late.first_token_s - quick.first_token_s
    assert delay == pytest.approx(late.transfer_s - (quick.transfer_s or 0.0))


def test_a_prompt_the_decode_worker_mostly_holds_is_prefilled_there() -> None:
    """Turn 2 adds one block to turn 1's 16: its decode worker holds 15 of turn 2's 16
    full blocks (89 % of the prompt, over the 0.8 rule), so it prefills the rest itself."""
    first = tuple(range(100, 116))
    trace = [
        TraceRequest("t1", 0.0, 16 * BLOCK_TOKENS - 100, 4, first),
        TraceRequest("t2", 5.0, 17 * BLOCK_TOKENS - 100, 4, (*first, 116)),
    ]
    result = simulate(trace, "kv_aware", pd_config(1, 1, cache_blocks=64))
    one, two = sorted(result.records, key=lambda r: r.arrival_s)
    assert one.prefill_worker_id == "p0" and one.cached_tokens == 0
    assert two.prefill_worker_id is None and two.transfer_s is None
    assert two.cached_tokens == 15 * BLOCK_TOKENS


def test_a_pd_fleet_is_refused_where_it_means_nothing() -> None:
    with pytest.raises(ValueError, match="decode worker"):
        pd_config(2, 0)
    with pytest.raises(ValueError, match="one router replica"):
        pd_config(router_replicas=2)
    with pytest.raises(ValueError, match="global"):
        Simulation("global", pd_config())


def test_cli_runs_a_pd_fleet_and_reports_its_pools() -> None:
    completed = run_simulate(
        "--prefill", "1", "--decode", "2", "--cache-tokens", "100000",
        "--policy", "cache_aware,kv_aware", "--profile", "tiny", "--json",
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    rows = json.loads(completed.stdout)
    assert all(r["requests"] == 6 and r["unfinished"] == 0 for r in rows)
    assert all(0 <= r["pd_remote_share"] <= 1 and r["pd_transfer_mean_s"] >= 0 for r in rows)
    table = run_simulate(
        "--prefill", "1", "--decode", "2", "--cache-tokens", "100000",
        "--policy", "kv_aware", "--profile", "tiny",
    )  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert "1 prefill + 2 decode workers" in table.stdout and "remote" in table.stdout
    refused = run_simulate("--prefill", "1", "--policy", "kv_aware")
    assert refused.returncode != 0 and "go together" in refused.stderr


def test_mixed_fleets_report_no_pd_figures() -> None:
    summary = summarize(simulate(conversations(3, 2, 1.0), "kv_aware", pd_config(0, 3)))
    assert summary.pd_remote_share is None and summary.pd_transfer_mean_s is None


def test_a_request_handed_over_mid_decode_run_joins_at_once() -> None:
    """The decode worker is in a long decode run when a transferred request arrives: the
    run is planned only up to the transfer's end, so the newcomer's first token comes
    after its prefill and transfer, not after the other request's 2,000 tokens."""
    trace = [
        TraceRequest("long", 0.0, 2 * BLOCK_TOKENS - 100, 2000, (1, 2)),
        TraceRequest("new", 0.5, 2 * BLOCK_TOKENS - 100, 4, (3, 4)),
    ]
    result = simulate(trace, "round_robin", pd_config(1, 1, transfer_gbps=12.5))
    new = next(r for r in result.records if r.arrival_s == 0.5)
    assert new.prefill_worker_id == "p0" and new.first_token_s is not None
    assert new.first_token_s - new.arrival_s < 0.2  # the long run lasts about 4 s
