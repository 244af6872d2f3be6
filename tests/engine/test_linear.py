"""Linear layers: packed for oneDNN on CPU, torch's own path on other devices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine.models.linear import Linear, onednn_packing_available


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_torch(dtype, with_bias):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator).to(dtype)
    bias = torch.randn(48, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(5, 32, generator=generator).to(dtype)
    residual = torch.randn(5, 48, generator=generator).to(dtype)
    layer = Linear(weight, bias)
    assert (layer.weight is not weight) == onednn_packing_available(torch.device("cpu"), dtype)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    # bf16: one rounding of the output (2^-8 relative) against the float32 reference.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layer(x).float(), expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(
        layer.add_to(residual, x).float(),
        residual.float() + expected,
        atol=tolerance,
        rtol=tolerance,
    )


def test_other_devices_keep_the_plain_weight():
    """No GPU here: the meta device stands in for CUDA (anything not CPU is not packed)."""
    weight = torch.empty(8, 4, device="meta")
    layer = Linear(weight, None)
    assert layer.weight is weight
    assert not onednn_packing_available(torch.device("cuda"), torch.float32)
    assert layer.add_to(
        torch.empty(2, 8, device="meta"), torch.empty(2, 4, device="meta")
    ).shape == (2, 8)
