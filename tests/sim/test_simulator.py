"""The simulator: real scheduler and cache in virtual time, policies compared on traces."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from kvserve.core.cost_model import profile
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import SchedulerConfig
from kvserve.sim.report import summarize
from kvserve.sim.simulator import SimConfig, simulate
from kvserve.sim.trace import BLOCK_TOKENS, TraceRequest, load_mooncake
from kvserve.sim.worker import SimWorker

FIXTURE = Path(__file__).parents[1] / "fixtures" / "mooncake_small.jsonl"
AZURE = Path(__file__).parents[1] / "fixtures" / "azure_small.csv"
TINY = profile("tiny")


def conversations(num: int, turns: int, gap_s: float, seed: int = 0) -> list[TraceRequest]:
    """``num`` conversations whose turn k repeats turn k-1's blocks plus two new ones;
    every prompt's last block is 100 tokens short."""
    rng = random.Random(seed)
    requests, next_id = [], 1000
    for conv in range(num):
        blocks: list[int] = []
        start = rng.uniform(0, gap_s)
        for turn in range(turns):
            blocks = [*blocks, next_id, next_id + 1]
            next_id += 2
            requests.append(
                TraceRequest(
                    f"c{conv}t{turn}",
                    start + turn * gap_s,
                    len(blocks) * BLOCK_TOKENS - 100,
                    8,
                    tuple(blocks),
                )
            )
    return sorted(requests, key=lambda r: r.arrival_s)


def config(workers: int = 4, cache_blocks: int = 64) -> SimConfig:
    return SimConfig(num_workers=workers, cache_tokens=cache_blocks * BLOCK_TOKENS, cost=TINY)


def test_trace_tokens_keep_the_sharing_and_the_length() -> None:
    first, second = load_mooncake(FIXTURE)[:2]
    a, b = first.prompt_token_ids(), second.prompt_token_ids()
    assert len(a) == first.input_tokens and len(b) == second.input_tokens
    assert a[: 2 * BLOCK_TOKENS] == b[: 2 * BLOCK_TOKENS]
    assert a[2 * BLOCK_TOKENS] != b[2 * BLOCK_TOKENS]


def test_decode_runs_match_single_steps() -> None:
    """Planning k decode steps at once ends at the same time in the same cache state."""

    def run(horizon_gap: float) -> tuple[float, int, int]:
        cache = KVCacheManager(64, 16)
        worker = SimWorker("w", cache, profile("llama3-8b-h100"), SchedulerConfig(256))
        for i, (prompt, out) in enumerate([(40, 50), (70, 33), (5, 81)]):
            worker.add(
                Request(
                    f"r{i}",
                    [i + 1] * prompt,
                    SamplingParams(max_tokens=out),
                    max_tokens=out,
                    namespace=b"n",
                    block_size=16,
                )
            )
        now, finished = 0.0, 0
        while worker.has_work:
            now += worker.start_step(now, now + horizon_gap)
            finished += len(worker.finish_step().finished)
            cache.check()
        return now, finished, cache.num_cached_blocks

    single, batched = run(0.0), run(float("inf"))
    assert single[1:] == batched[1:] == (3, single[2])
    assert batched[0] == pytest.approx(single[0], rel=1e-9)


def test_cache_aware_policies_find_conversations_round_robin_does_not() -> None:
    trace = conversations(num=13, turns=4, gap_s=5.0)  # 13: not a multiple of 4
    hits = {
        p: summarize(simulate(trace, p, config())).hit_rate
        for p in ("round_robin", "cache_aware", "kv_aware", "global")
    }
    # Turn k's prompt holds turn k-1's 2k blocks, but only the first 2k-1 were full
    # (its last one was 100 tokens short): 1 + 3 + 5 cached blocks of 4 prompts.
    cached, prompt = 9 * BLOCK_TOKENS, sum(n * BLOCK_TOKENS - 100 for n in (2, 4, 6, 8))
    assert hits["global"] == pytest.approx(cached / prompt)
    assert hits["kv_aware"] == pytest.approx(hits["global"], abs=0.02)
    assert hits["cache_aware"] == pytest.approx(hits["global"], abs=0.02)
    assert hits["round_robin"] < hits["global"] / 2


def test_cache_pressure_costs_hits_and_loses_no_request() -> None:
    trace = conversations(num=30, turns=3, gap_s=2.0, seed=3)
    roomy, tight = (
        summarize(simulate(trace, "kv_aware", config(workers=3, cache_blocks=blocks)))
        for blocks in (64, 12)
    )
    assert roomy.hit_rate > 2 * tight.hit_rate
    assert roomy.requests == tight.requests == len(trace)
    assert roomy.rejected == tight.rejected == 0


def test_a_prompt_longer_than_the_cache_is_rejected_not_stuck() -> None:
    trace = [
        TraceRequest("big", 0.0, 10 * BLOCK_TOKENS, 4, tuple(range(10))),
        TraceRequest("ok", 0.1, BLOCK_TOKENS, 4, (99,)),
    ]
    summary = summarize(simulate(trace, "kv_aware", config(workers=1, cache_blocks=4)))
    assert (summary.requests, summary.rejected) == (2, 1)


def run_simulate(*args: str, trace: Path = FIXTURE) -> subprocess.CompletedProcess[str]:
    """``kvserve simulate`` on a fixture trace, as a user runs it."""
    command = [sys.executable, "-c", "from kvserve.cli import main; main()", "simulate"]
    return subprocess.run(
        [*command, "--trace", str(trace), *args], capture_output=True, text=True, timeout=60
    )


def test_cli_writes_table_json_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    completed = run_simulate(
        "--workers", "2", "--cache-tokens", "100000", "--policy", "round_robin,kv_aware,global",
        "--profile", "tiny", "--json", "--out", str(out),
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    rows = json.loads(completed.stdout)
    assert [r["policy"] for r in rows] == ["round_robin", "kv_aware", "global"]
    assert all(r["requests"] == 6 and 0 <= r["hit_rate"] <= 1 for r in rows)
    assert {p.name for p in out.iterdir()} >= {
        "results.json",
        "report.md",
        "sim_ttft_cdf.png",
        "sim_hit_rate_ttft.png",
    }


def test_cli_prints_a_table_with_its_setup_and_explains_its_columns(tmp_path: Path) -> None:
    completed = run_simulate(
        "--workers", "2", "--cache-tokens", "100000", "--policy", "round_robin,kv_aware",
        "--profile", "tiny", "--out", str(tmp_path),
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    text = completed.stdout
    assert "|---" not in text  # a terminal table, not raw markdown
    assert "mooncake_small.jsonl (6 requests" in text and "2 workers x 100,000 cache tokens" in text
    assert "imbalance: the busiest worker's computed tokens / the mean" in text
    report = (tmp_path / "report.md").read_text()
    assert "2 workers x 100,000 cache tokens" in report and "- hit rate: prompt tokens" in report
    for plot in ("sim_ttft_cdf.png", "sim_hit_rate_ttft.png"):
        with Image.open(tmp_path / plot) as image:
            assert "trace mooncake_small.jsonl" in image.text["Title"]


def test_cli_reads_an_azure_trace_and_says_it_shares_nothing(tmp_path: Path) -> None:
    completed = run_simulate(
        "--workers", "2", "--cache-tokens", "100000", "--policy", "round_robin,kv_aware",
        "--profile", "tiny", "--out", str(tmp_path), trace=AZURE,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert "azure_small.csv has no prefix sharing" in completed.stdout
    rows = json.loads((tmp_path / "results.json").read_text())
    assert all(r["requests"] == 5 and r["hit_rate"] == 0.0 for r in rows)
    assert "no prefix sharing" in (tmp_path / "report.md").read_text()


def test_cli_refuses_an_unknown_policy() -> None:
    completed = run_simulate("--policy", "psychic")
    assert completed.returncode != 0 and "unknown policy" in completed.stderr


@pytest.mark.parametrize(
    ("flag", "good", "reason"),
    [
        ("--kv-aware-recompute-weight", "0", "recompute_weight must be >= 0"),
        ("--kv-aware-home-weight", "3", "home_weight must be >= 0"),
        ("--kv-aware-home-slack-queue", "inf", "home_slack_queue_s must be >= 0"),
        ("--kv-aware-recompute-slack-queue", "12", "recompute_slack_queue_s must be >= 0"),
    ],
)
def test_cli_takes_a_kv_aware_weight_and_refuses_a_negative_one(
    flag: str, good: str, reason: str
) -> None:
    args = ["--workers", "2", "--cache-tokens", "100000", "--policy", "kv_aware"]
    args += ["--profile", "tiny", "--json"]
    completed = run_simulate(*args, flag, good)
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)[0]["requests"] == 6
    refused = run_simulate(*args, flag, "-1")
    assert refused.returncode != 0 and reason in refused.stderr


def test_cli_names_the_arrival_rate_it_simulated() -> None:
    """--speedup 4 compresses arrival times 4x: four times the trace's arrival rate."""
    completed = run_simulate(
        "--workers", "2", "--cache-tokens", "100000", "--policy", "round_robin",
        "--profile", "tiny", "--speedup", "4",
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert "arrivals x4)" in completed.stdout


def test_cli_takes_kv_aware_retention_parameters_and_refuses_bad_ones() -> None:
    args = ["--workers", "2", "--cache-tokens", "100000", "--policy", "kv_aware"]
    args += ["--profile", "tiny", "--json", "--kv-aware-recompute-weight", "8"]
    completed = run_simulate(
        *args, "--kv-aware-retention-margin", "2", "--kv-aware-retention-window", "30"
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)[0]["requests"] == 6
    refused = run_simulate(*args, "--kv-aware-retention-window", "0")
    assert refused.returncode != 0 and "retention window must be > 0" in refused.stderr


def test_cli_takes_the_kv_aware_replica_flags_and_refuses_negative_ones() -> None:
    args = ["--workers", "2", "--cache-tokens", "100000", "--policy", "kv_aware"]
    args += ["--profile", "tiny", "--json", "--router-replicas", "2"]
    salt = ("--kv-aware-replica-spread", "0.05", "--kv-aware-replica-burst-window", "0.01")
    completed = run_simulate(*args, *salt, "--kv-aware-replica-stagger", "0.002")
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)[0]["requests"] == 6
    for flag, field in (
        ("--kv-aware-replica-spread", "replica_spread_s"),
        ("--kv-aware-replica-burst-window", "replica_burst_window_s"),
        ("--kv-aware-replica-stagger", "replica_stagger_s"),
    ):
        refused = run_simulate(*args, flag, "-1")
        assert refused.returncode != 0 and f"{field} must be >= 0" in refused.stderr


def test_goodput_is_the_share_of_all_requests_meeting_the_slo() -> None:
    """The rejected request misses any SLO; the served one meets a generous one and
    misses one shorter than its own TTFT."""
    trace = [
        TraceRequest("big", 0.0, 10 * BLOCK_TOKENS, 4, tuple(range(10))),
        TraceRequest("ok", 0.1, BLOCK_TOKENS, 4, (99,)),
    ]
    result = simulate(trace, "kv_aware", config(workers=1, cache_blocks=4))
    served = [r for r in result.records if r.first_token_s is not None]
    ttft = served[0].first_token_s - served[0].arrival_s
    assert summarize(result).goodput is None
    assert summarize(result, slo_ttft_s=ttft * 10).goodput == pytest.approx(0.5)
    assert summarize(result, slo_ttft_s=ttft / 10).goodput == 0.0


def test_cli_reports_goodput_for_an_slo_and_refuses_a_non_positive_one() -> None:
    args = ["--workers", "2", "--cache-tokens", "100000", "--policy", "kv_aware,round_robin"]
    args += ["--profile", "tiny"]
    completed = run_simulate(*args, "--json", "--slo-ttft", "1000")
    assert completed.returncode == 0, completed.stderr
    assert [r["goodput"] for r in json.loads(completed.stdout)] == [1.0, 1.0]
    table = run_simulate(*args, "--slo-ttft", "1000")
    assert table.returncode == 0 and "goodput" in table.stdout
    refused = run_simulate(*args, "--slo-ttft", "0")
    assert refused.returncode != 0 and "--slo-ttft must be > 0" in refused.stderr


def test_cli_finds_each_policys_max_rate_meeting_the_slo() -> None:
    args = ["--workers", "2", "--cache-tokens", "100000", "--policy", "kv_aware"]
    args += ["--profile", "tiny", "--slo-ttft", "0.02"]
    completed = run_simulate(*args, "--find-max-rate", "--json")
    assert completed.returncode == 0, completed.stderr
    (row,) = json.loads(completed.stdout)
    probes = {p["rate"]: p["ttft_p99_s"] for p in row["probes"]}
    assert row["max_rate"] in probes and probes[row["max_rate"]] <= 0.02
    assert any(p99 > 0.02 and rate > row["max_rate"] for rate, p99 in probes.items())
    refused = run_simulate(*args[:-2], "--find-max-rate")
    assert refused.returncode != 0 and "--find-max-rate needs --slo-ttft" in refused.stderr
