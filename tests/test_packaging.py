"""The package's own metadata: it builds without deprecation warnings and says its license."""

from __future__ import annotations

import subprocess
import sys
from email.parser import Parser
from pathlib import Path

from tests.support.processes import REPO_ROOT

_BUILD_METADATA = """
import sys, warnings
warnings.simplefilter("always")
from setuptools import build_meta
print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))
"""


def test_metadata_builds_without_deprecation_warnings(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _BUILD_METADATA, str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    output = result.stdout + result.stderr
    assert "deprecat" not in output.lower(), output
    dist_info = tmp_path / result.stdout.strip().splitlines()[-1]
    metadata = Parser().parsestr((dist_info / "METADATA").read_text())
    assert metadata["License-Expression"] == "Apache-2.0"
