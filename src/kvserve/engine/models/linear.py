"""Linear layers whose weights are laid out once, at load, for the device's fastest GEMM.

On CPU, torch's plain ``addmm`` repacks the weight into the GEMM's blocked layout on every
call; at serving batch sizes (16-512 rows) that repacking is a large share of the call.
oneDNN (reachable through torch's ``mkldnn`` ops) takes a weight reordered once into its
own layout and fuses the residual add into the GEMM's epilogue: measured 1.2-1.9x faster
on a 1024-wide model's shapes in float32 and 1.0-1.45x in bfloat16 (docs/benchmarks.md).
CUDA (and dtypes oneDNN does not pack) keep torch's own path, whose kernels need no
prepacking.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` on ``device`` are packed for oneDNN."""
    return (
        device.type == "cpu"
        and dtype in _PACKED_DTYPES
        and torch._C._has_mkldnn
        and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class Linear:
    """``x @ weight.T (+ bias)``, optionally added to a residual in the same op."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self._packed = onednn_packing_available(weight.device, weight.dtype)
        # The packed tensor is opaque (oneDNN's layout); only the mkldnn ops read it.
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            if self._packed
            else weight
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.weight, self.bias, "none", [], ""
            )
            return out
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``: one op (the add in the GEMM's epilogue) where possible."""
        if self._packed:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self.weight, self.bias, "add"
            )
            return out
        if self.bias is None:
            return torch.addmm(residual, x, self.weight.t())
        return residual + F.linear(x, self.weight, self.bias)


class GatedUp:
    """``silu(x @ gate.T) * (x @ up.T)``, the gated MLP's first half.

    Packed for oneDNN it is two GEMMs whose epilogues do the rest (swish on the gate, then
    the up projection multiplied by it): no [tokens, 2 × intermediate] product to split,
    and no separate SiLU and multiply passes over it. On a 1024-wide model's shapes, float32,
    2,048 rows: 108 against 122 ms on one thread, 58 against 68 on two; at 16 rows within
    6% either way (docs/benchmarks.md). Elsewhere one fused GEMM, then SiLU and multiply.
    """

    def __init__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        gate_bias: torch.Tensor | None,
        up_bias: torch.Tensor | None,
    ) -> None:
        self._packed = onednn_packing_available(gate.device, gate.dtype)
        if self._packed:
            self._gate, self._up = Linear(gate, gate_bias), Linear(up, up_bias)
        else:
            both = gate_bias is not None and up_bias is not None
            bias = torch.cat([gate_bias, up_bias]) if both else None  # type: ignore[list-item]
            self._gate_up = Linear(torch.cat([gate, up]), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed:
            gate = torch.ops.mkldnn._linear_pointwise(
                x, self._gate.weight, self._gate.bias, "swish", [], ""
            )
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
                x, gate, self._up.weight, self._up.bias, "mul"
            )
            return out
        gate, up = self._gate_up(x).chunk(2, dim=-1)
        return F.silu(gate) * up
