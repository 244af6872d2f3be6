"""Tiny random-weight model folders, made once per test session, for the engine's tests
and the model folder's (tokenizer, chat template) tests."""

from __future__ import annotations

from pathlib import Path

import pytest

# Before any test module imports torch: the engines tests run in this process get the
# engine's own OpenMP wait settings (libgomp reads them once, when torch loads it).
import kvserve.engine  # noqa: F401


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
