"""The C++ RMSNorm and Q/K norm + RoPE (``csrc/norm_rope.cpp``) against the torch ops the
model runs where the kernels are not used (CUDA, no compiler), computed in float64 from the
same inputs: float32 must agree to summation order, bf16 to one rounding of the output
(torch's bf16 ops round between passes, so they are no closer than that themselves)."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine import paged_kernel
from kvserve.engine.models.llama import rms_norm
from kvserve.engine.models.rope import apply_rotary

EPS = 1e-6


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert paged_kernel.load(), "the C++ kernels did not build: no C++ compiler?"


def assert_matches(ours: torch.Tensor, exact: torch.Tensor) -> None:
    """float32: summation order only; bf16: one rounding to its 8-bit mantissa (2^-8)."""
    assert ours.dtype in (torch.float32, torch.bfloat16)
    tolerance = 1e-5 if ours.dtype == torch.float32 else 2**-8
    torch.testing.assert_close(ours.double(), exact, atol=1e-6, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_rms_norm_matches_torch(dtype, rows):
    """Rows of a hidden state, with one weight for all (rows > 32 spread over threads)."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 1024, generator=gen) * 3).to(dtype)
    weight = (torch.rand(1024, generator=gen) + 0.5).to(dtype)
    ours = torch.ops.kvserve_kernels.rms_norm(x, weight, EPS)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert_matches(ours, rms_norm(x.double(), weight.double(), EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_heads_in_a_wider_tensor_with_a_weight_per_head(dtype):
    """Qwen3's stacked per-head norms, on the Q/K heads viewed out of the fused QKV."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 8, 16, generator=gen).to(dtype)
    weight = (torch.rand(6, 16, generator=gen) + 0.5).to(dtype)
    qk = qkv[:, :6]  # not contiguous: a token's 6 heads, then 2 more skipped
    ours = torch.ops.kvserve_kernels.rms_norm(qk, weight, EPS)
    assert_matches(ours, rms_norm(qk.double(), weight.double(), EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False], ids=["qk norm", "no norm"])
def test_qk_norm_rope_rotates_q_and_k_in_place_and_leaves_v(dtype, with_norm):
    """The first ``rotated`` heads as the model's torch path leaves them (norm, then
    rotation by a gathered cos/sin table); V's heads untouched."""
    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, head_dim = 11, 4, 2, 32
    rotated = heads + kv_heads
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    weight = (torch.rand(rotated, head_dim, generator=gen) + 0.5).to(dtype) if with_norm else None
    table_cos = torch.randn(50, head_dim, generator=gen).to(dtype)
    table_sin = torch.randn(50, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 50, (tokens,), generator=gen)
    cos, sin = table_cos[positions][:, None], table_sin[positions][:, None]

    exact = qkv.double()
    qk = exact[:, :rotated]
    if weight is not None:
        qk = rms_norm(qk, weight.double(), EPS)
    apply_rotary(qk.clone(), cos.double(), sin.double(), out=exact[:, :rotated])
    ours = qkv.clone()
    torch.ops.kvserve_kernels.qk_norm_rope_(ours, weight, cos, sin, rotated, EPS)
    assert_matches(ours, exact)
    assert torch.equal(ours[:, rotated:], qkv[:, rotated:])
