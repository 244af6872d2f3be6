"""Engine tests run torch on one thread, once per attention path; their model folders come
from ``tests/conftest.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvserve.engine import paged_kernel

# Two cores are shared by every test process; more threads only add contention.
torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["paged kernel", "torch attention"])
def attention_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a module's tests once with the C++ paged kernel and once with the pure-torch
    attention (gather + SDPA, decode rows) that CUDA and compiler-less installs use."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "torch attention":
            patch.setenv(paged_kernel.ENV_SWITCH, "0")
        else:
            assert paged_kernel.load(), "the paged kernel did not build: no C++ compiler?"
        yield request.param
