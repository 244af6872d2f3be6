"""Shared engine fixtures: tiny random-weight model folders, made once per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvserve.engine import paged_kernel
from kvserve.engine.tiny_model import ARCHES, make_tiny_model

# Two cores are shared by every test process; more threads only add contention.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folder of each tiny model family (llama, qwen2, qwen3), seed 0."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(root / arch, arch, seed=0) for arch in ARCHES}


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    """The tiny Llama folder: the default model for engine tests."""
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module", params=["paged kernel", "torch attention"])
def attention_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a module's tests once with the C++ paged kernel and once with the pure-torch
    attention (gather + SDPA, decode rows) that CUDA and compiler-less installs use."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "torch attention":
            patch.setenv(paged_kernel.ENV_SWITCH, "0")
        yield request.param
