"""Engine tests run torch on one thread; their model folders come from ``tests/conftest.py``."""

from __future__ import annotations

import torch

# Two cores are shared by every test process; more threads only add contention.
torch.set_num_threads(1)
