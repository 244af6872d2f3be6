"""``kvserve bench`` and ``kvserve bench compare`` as a user runs them: a real process
against a loopback server, its files, Ctrl-C, and usage errors."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from typer.testing import CliRunner

from kvserve.cli import app
from kvserve.router.local_fleet import KVSERVE_COMMAND
from kvserve.router.ports import free_port
from tests.bench.scripted_server import ScriptedServer
from tests.support.processes import REPO_ROOT

MOONCAKE = REPO_ROOT / "tests/fixtures/mooncake_small.jsonl"
PLOTS = ("ttft_cdf.png", "hit_rate_throughput.png", "requests_per_worker.png")


async def kvserve(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *KVSERVE_COMMAND,
        *args,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def bench(url: str, out: Path, *extra: str) -> tuple[int, str]:
    workload = f"mooncake:{MOONCAKE},block_tokens=16,max_tokens=4"
    args = ["--endpoint", url, "--workload", workload, "--time-scale", "0.1", "--out", str(out)]
    process = await kvserve("bench", *args, *extra)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, (stdout + stderr).decode()


async def test_a_run_writes_results_report_and_plots_and_compare_overlays_runs(tmp_path) -> None:
    async with ScriptedServer(["ok", "http400"]) as server:
        code, first_output = await bench(server.url, tmp_path / "a", "--label", "first")
        assert code == 0, first_output
        code, output = await bench(
            server.url, tmp_path / "b", "--label", "second", "--api-key", "s3"
        )
        assert code == 0, output
    assert "prefix hit rate" in output and "stopped by completed" in output
    # Errors reach the console by kind, with the first message of each kind.
    assert "errors `HTTP 400`: 1 (e.g. HTTP 400: max_tokens is too large)" in first_output
    results = json.loads((tmp_path / "a/results.json").read_text())
    # Which router policy and which workers served the run, from the response headers.
    assert results["config"]["router_policy"] == "scripted"
    assert results["config"]["workers"] == "scripted-0"
    assert results["summary"]["router_policies"] == {"scripted": 6}
    assert results["summary"]["requests"] == 6 and results["summary"]["errors"] == 1
    assert results["config"]["model"] == "foreign"  # asked /v1/models
    assert len(results["requests"]) == 6  # in completion order: the refused one may be first
    assert all(r["ttft_s"] > 0 for r in results["requests"] if r["error"] is None)
    second = json.loads((tmp_path / "b/results.json").read_text())
    assert second["summary"]["prefix_hit_rate"] > 0.8  # it saw all but the refused prompt
    assert "s3" not in second["config"]["command"]
    report = (tmp_path / "a/report.md").read_text()
    assert "| prefix hit rate |" in report and "errors `HTTP 400`: 1 (e.g. HTTP 400:" in report
    assert "- router_policy: `scripted`" in report and "- command: `kvserve bench" in report
    for plot in PLOTS:
        assert (tmp_path / "a" / plot).read_bytes().startswith(b"\x89PNG")
        assert f"]({plot})" in report

    process = await kvserve("bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"),
                            "--out", str(tmp_path / "cmp"))  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    page = (tmp_path / "cmp/compare.md").read_text()
    assert "| metric | first | second |" in page
    assert all((tmp_path / "cmp" / plot).is_file() for plot in PLOTS)


async def test_ctrl_c_stops_and_still_reports(tmp_path) -> None:
    async with ScriptedServer(["ok", "hang", "hang", "hang"], token_delay_s=0.0) as server:
        process = await kvserve(
            "bench", "--endpoint", server.url, "--model", "m", "--workload", "multi-turn:turns=2",
            "--concurrency", "3", "--out", str(tmp_path),
        )  # fmt: skip
        # The fourth request is the first conversation's second turn: it is sent only once
        # the "ok" first turn has been recorded, and then three streams hang.
        while len(server.received) < 4 or server.in_flight < 3:
            await asyncio.sleep(0.02)
        process.send_signal(signal.SIGINT)
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 0, stderr.decode()
        await server.wait_until_no_stream_open()  # the cancelled streams were closed
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["stopped_by"] == "interrupted"
    assert results["config"]["abandoned_in_flight"] == 3
    assert results["summary"]["requests"] >= 1
    assert (tmp_path / "report.md").is_file()


def test_usage_errors_exit_2_with_a_reason(tmp_path) -> None:
    runner = CliRunner()
    cases = [
        (["--workload", "nope"], "unknown workload"),
        (["--workload", "few-shot"], "no timestamps: give --rate or --concurrency"),
        (["--workload", "few-shot", "--rate", "1", "--concurrency", "2"], "choose one of"),
        (["--workload", f"mooncake:{MOONCAKE}"], "cannot list models"),
    ]
    endpoint = f"http://127.0.0.1:{free_port()}"
    for args, reason in cases:
        result = runner.invoke(
            app, ["bench", "--endpoint", endpoint, "--out", str(tmp_path), *args]
        )
        assert result.exit_code == 2, result.output
        assert reason in result.output.replace("\n", " ").replace("│", ""), result.output
    result = runner.invoke(app, ["bench", "compare", str(tmp_path)])
    assert result.exit_code == 2 and "no results.json" in result.output


def test_bench_imports_no_torch() -> None:
    import subprocess

    code = "import kvserve.bench.run, kvserve.cli, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
