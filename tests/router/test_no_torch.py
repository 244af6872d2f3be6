"""The router installs and starts without torch: importing it must not load torch."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import kvserve.router
from kvserve.cli import main
sys.argv = ["kvserve", "router", "--help"]
try:
    main()
except SystemExit:
    pass
print("torch loaded" if "torch" in sys.modules else "torch not loaded")
"""


def test_router_and_its_help_leave_torch_unloaded() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    assert "--worker-urls" in result.stdout
    assert result.stdout.strip().endswith("torch not loaded")
