"""Default dtype and thread choices."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvserve.engine.device import (
    cpu_has_native_bf16,
    parse_dtype,
    pick_dtype,
    use_threads,
)
from kvserve.engine.tiny_model import make_tiny_model
from kvserve.model_folder.config import ModelConfig


@pytest.mark.parametrize("declared", ["float32", "bfloat16"])
def test_cpu_runs_bf16_checkpoints_in_bf16_only_with_native_bf16(tmp_path, declared):
    config = ModelConfig.from_dir(make_tiny_model(tmp_path, "qwen2", dtype=declared))
    cpu = torch.device("cpu")
    native = declared == "bfloat16" and cpu_has_native_bf16()
    assert pick_dtype(config, cpu, None) == (torch.bfloat16 if native else torch.float32)
    assert pick_dtype(config, cpu, torch.float32) == torch.float32
    assert pick_dtype(config, torch.device("cuda"), None) == getattr(torch, declared)


def test_native_bf16_follows_the_cpu_flags():
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next(line for line in cpuinfo if line.startswith("flags")).split()
    assert cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_parse_dtype():
    assert parse_dtype("auto") is None and parse_dtype(None) is None
    assert parse_dtype("bfloat16") == torch.bfloat16
    assert parse_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="choose one of auto"):
        parse_dtype("int8")


def test_threads_default_to_every_cpu_the_process_may_use():
    before = torch.get_num_threads()
    try:
        assert use_threads(None) == len(os.sched_getaffinity(0)) == torch.get_num_threads()
        assert use_threads(1) == 1 == torch.get_num_threads()
        with pytest.raises(ValueError):
            use_threads(0)
    finally:
        torch.set_num_threads(before)


def _openmp_env_after_import(env: dict[str, str]) -> tuple[str | None, str | None]:
    code = (
        "import os, kvserve.engine; "
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return tuple(None if word == "None" else word for word in out)  # type: ignore[return-value]


def test_openmp_threads_spin_through_a_step_unless_the_user_says_otherwise():
    """Linux (these tests' machines) counts what the thread governor reads: the spin that
    spans a step's ops; elsewhere 1,000 spins."""
    assert _openmp_env_after_import({}) == (None, "100000")
    assert _openmp_env_after_import({"GOMP_SPINCOUNT": "50"}) == (None, "50")
    assert _openmp_env_after_import({"OMP_WAIT_POLICY": "PASSIVE"}) == ("PASSIVE", None)
