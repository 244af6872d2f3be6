"""``kvserve bench`` against real processes: a kvserve worker serving the tiny model,
and a kvserve router over two of them. The trace's sharing must reach the engine's
prefix cache as cached tokens, and the router's worker header must reach the report."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.router.local_fleet import KVSERVE_COMMAND, LocalFleet
from kvserve.router.ports import free_port
from tests.support.processes import REPO_ROOT

MOONCAKE = REPO_ROOT / "tests/fixtures/mooncake_small.jsonl"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """Two workers on the tiny model behind a cache_aware router, as ``kvserve up`` runs them."""
    model = tmp_path_factory.mktemp("tiny-model")
    subprocess.run(
        [*KVSERVE_COMMAND, "make-tiny-model", str(model)], check=True, capture_output=True
    )
    fleet = LocalFleet(
        model, workers=2, policy="cache_aware", host="127.0.0.1", port=free_port(),
        log_dir=tmp_path_factory.mktemp("fleet-logs"),
    )  # fmt: skip
    fleet.start(timeout_s=120)
    try:
        yield fleet
    finally:
        fleet.stop()


def bench(endpoint: str, out: Path, workload: str, *pacing: str) -> dict:
    args = ["bench", "--endpoint", endpoint, "--workload", workload, "--out", str(out)]
    result = subprocess.run(
        [*KVSERVE_COMMAND, *args, "--ignore-eos", *pacing],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((out / "results.json").read_text())


def test_replay_against_a_worker_reaches_its_prefix_cache(fleet, tmp_path: Path) -> None:
    worker = fleet.processes[0]
    workload = f"mooncake:{MOONCAKE},block_tokens=16,mode=tokens,vocab=999,max_tokens=4"
    results = bench(worker.url, tmp_path, workload, "--concurrency", "1")
    records = sorted(results["requests"], key=lambda r: r["item"])
    assert [r["error"] for r in records] == [None] * 6
    assert [r["prompt_tokens"] for r in records] == [47, 64, 22, 38, 80, 35]
    worker_id = worker.url.removeprefix("http://")  # a worker names itself host:port
    assert all(r["completion_tokens"] == 4 and r["worker"] == worker_id for r in records)
    # Row 1 shares hash ids [0, 1] with row 0: two full 16-token blocks; row 3 shares none.
    assert records[1]["cached_tokens"] == 32
    assert records[3]["cached_tokens"] == 0
    assert results["summary"]["prefix_hit_rate"] > 0.3


def test_replay_through_a_router_reports_the_serving_workers(fleet, tmp_path: Path) -> None:
    workload = "shared-prefix:requests=24,n_prefixes=2,prefix_len=64,suffix_len=8,"
    workload += "mode=tokens,vocab=999,max_tokens=4"
    results = bench(fleet.url, tmp_path, workload, "--rate", "20")
    summary = results["summary"]
    assert summary["errors"] == 0, summary["error_kinds"]
    assert sum(summary["requests_per_worker"].values()) == 24
    assert set(summary["requests_per_worker"]) <= {"w0", "w1"}  # the router's worker ids
    assert summary["prefix_hit_rate"] > 0.6
    assert all(r["ttft_s"] > 0 and len(r["itl_s"]) >= 1 for r in results["requests"])
