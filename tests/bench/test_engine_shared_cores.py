"""``benchmarks/engine_shared_cores.py`` runs each wait setting through its three phases
and reports whether the governed engine's waits were short."""

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
    assert "long waits" in out, out  # the governed engine alone
    short_spin = [line for line in out.splitlines() if line.lstrip().startswith("short-spin ")]
    assert all(line.endswith("not governed") for line in short_spin), out  # a user's wait
