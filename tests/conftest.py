"""Tiny random-weight model folders, made once per test session, for the engine's tests
and the model folder's (tokenizer, chat template) tests."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before any test module imports torch: the engines tests run in this process get the
# engine's own OpenMP wait settings (libgomp reads them once, when torch loads it).
import kvserve.engine  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_the_session_folder(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """Every temporary file the tests and the servers they start make (servers' logs,
    vLLM's IPC sockets) goes to pytest's session folder, which pytest prunes to the last
    three runs, instead of accumulating in /tmp (thousands a day over repeated runs)."""
    folder = tmp_path_factory.mktemp("tmp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(folder))  # processes the tests start
        patch.setattr(tempfile, "tempdir", str(folder))  # this process
        yield


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folder of each tiny model family (llama, qwen2, qwen3), seed 0."""
    from kvserve.engine.tiny_model import ARCHES, make_tiny_model  # torch: only when used

    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(root / arch, arch, seed=0) for arch in ARCHES}


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    """The tiny Llama folder: the default model for engine tests."""
    return tiny_model_dirs["llama"]
