"""The package's own metadata: it builds without deprecation warnings and says its license."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
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


_BUILD_WHEEL = """
import sys
import zipfile
from setuptools import build_meta
print(build_meta.build_wheel(sys.argv[1]))
"""


def test_the_wheel_ships_the_dashboards_page_and_script(tmp_path: Path) -> None:
    """A non-editable install serves ``/dashboard`` from these files. Built from a copy of
    the sources, so that no ``build/`` folder is left in the checkout."""
    source = tmp_path / "source"
    shutil.copytree(REPO_ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    result = subprocess.run(
        [sys.executable, "-c", _BUILD_WHEEL, str(tmp_path)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    wheel = tmp_path / result.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    static = "kvserve/router/dashboard/static/"
    assert {static + n for n in ("index.html", "dashboard.js", "dashboard.css")} <= names
