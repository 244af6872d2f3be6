"""Engine tests run torch on one thread, once per attention path; their model folders come
from ``tests/conftest.py``.

The oracle tests run on the CPU unless ``KVSERVE_TEST_DEVICE`` names another device
(``cuda``): CI has no GPU, and a session lent one runs them there. The C++ paged kernel
is CPU-only, so on a GPU only the torch attention path runs."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from kvserve.engine import paged_kernel

# Two cores are shared by every test process; more threads only add contention.
torch.set_num_threads(1)


TEST_DEVICE = os.environ.get("KVSERVE_TEST_DEVICE", "cpu")
ATTENTION_PATHS = (
    ["torch attention"] if TEST_DEVICE != "cpu" else ["paged kernel", "torch attention"]
)


@pytest.fixture(scope="session")
def device() -> str:
    """Where the oracle tests run both the engine and transformers."""
    return TEST_DEVICE


@pytest.fixture(scope="module", params=ATTENTION_PATHS)
def attention_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a module's tests once with the C++ paged kernel and once with the pure-torch
    attention (gather + SDPA, decode rows) that CUDA and compiler-less installs use."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "torch attention":
            patch.setenv(paged_kernel.ENV_SWITCH, "0")
        else:
            assert paged_kernel.load(), "the paged kernel did not build: no C++ compiler?"
        yield request.param
