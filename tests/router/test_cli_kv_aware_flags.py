"""``kvserve router`` takes kv_aware's future-cost parameters and refuses bad ones."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvserve.cli import app


@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        ("--kv-aware-recompute-weight", "-1", "recompute_weight must be >= 0"),
        ("--kv-aware-home-weight", "-1", "home_weight must be >= 0"),
        ("--kv-aware-home-slack-queue", "-0.1", "home_slack_queue_s must be >= 0"),
        ("--kv-aware-recompute-slack-queue", "-1", "recompute_slack_queue_s must be >= 0"),
        ("--kv-aware-retention-margin", "-0.5", "retention margin must be >= 0"),
        ("--kv-aware-retention-window", "0", "retention window must be > 0"),
        ("--kv-aware-replica-spread", "-0.01", "replica_spread_s must be >= 0"),
        ("--kv-aware-replica-burst-window", "-1", "replica_burst_window_s must be >= 0"),
        ("--kv-aware-replica-stagger", "-1", "replica_stagger_s must be >= 0"),
    ],
)
def test_a_bad_kv_aware_parameter_is_a_usage_error(flag: str, value: str, reason: str) -> None:
    result = CliRunner().invoke(
        app,
        ["router", "--policy", "kv_aware", "--worker-urls", "http://127.0.0.1:9", flag, value],
    )
    assert result.exit_code == 2, result.output
    assert reason in " ".join(result.output.split())


def test_help_lists_the_future_cost_flags() -> None:
    result = CliRunner().invoke(app, ["router", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in (
        "--kv-aware-recompute-weight",
        "--kv-aware-home-weight",
        "--kv-aware-home-slack-queue",
        "--kv-aware-recompute-slack-queue",
        "--kv-aware-retention-margin",
        "--kv-aware-retention-window",
        "--kv-aware-replica-spread",
        "--kv-aware-replica-burst-window",
        "--kv-aware-replica-stagger",
    ):
        assert flag in result.output
