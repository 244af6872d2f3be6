"""``benchmarks/engine_shared_cores.py`` runs each wait setting through its three phases
and reports, each round, which waits the governed engine chose."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_shared_cores.py"


def test_each_setting_runs_alone_shared_and_alone_again(tiny_model_dir: Path) -> None:
    command = [
        sys.executable,
        str(SCRIPT),
        "--model",
        str(tiny_model_dir),
        "--seconds",
        "6",
        "--hogs",
        "1",
        "--batch",
        "2",
        "--prompt-len",
        "16",
        "--output-len",
        "4",
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True).stdout
    for setting in ("governed", "short-spin"):
        phases = set(re.findall(rf"^\s*{setting}\s+[\d.]+ s\s+(\w[\w ]*?):", out, re.MULTILINE))
        assert phases == {"alone", "shared", "alone again"}, out
        assert re.search(rf"^\s*{setting}: alone [\d.]+, shared [\d.]+, alone again", out, re.M)
    # The governed engine says which waits it chose on every round. Which ones depends on
    # what else runs on the box (alone on an idle one: long; beside other jobs: short from
    # the start), so that is the governor's own tests' question (tests/engine/
    # test_thread_governor.py, on given counters), not this script's on a loaded CI box.
    governed = _rounds(out, "governed")
    assert governed, out
    assert all(
        re.search(r":\s+[\d.]+ tok/s, (short|long) waits, \d+ change", line) for line in governed
    ), out
    short_spin = _rounds(out, "short-spin")
    assert all(line.endswith("not governed") for line in short_spin), out  # a user's wait


def _rounds(out: str, setting: str) -> list[str]:
    """The script's line per round of ``setting`` (not its summary line)."""
    return [line for line in out.splitlines() if line.lstrip().startswith(f"{setting} ")]
