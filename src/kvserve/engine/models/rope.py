"""Rotary position embedding tables, computed the way transformers computes them.

Matching the oracle token for token needs the same float32 inverse frequencies, so each
scaling type follows the published formula step by step (default, linear, Llama 3, YaRN).
"""

from __future__ import annotations

import math

import torch

from kvserve.model_folder.config import RopeConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Long wavelengths are divided by ``factor``, short ones kept, the middle blended."""
    inv_freq = _base_inv_freq(rope.theta, dim)
    factor = rope.get("factor")
    low_freq_factor = rope.get("low_freq_factor")
    high_freq_factor = rope.get("high_freq_factor")
    old_context = rope.get("original_max_position_embeddings")
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Interpolate low frequencies, extrapolate high ones, ramp in between; scale cos/sin."""
    factor = rope.get("factor")
    original = rope.get("original_max_position_embeddings")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


def inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies ``[dim // 2]`` and the factor applied to cos and sin."""
    if rope.rope_type == "linear":
        return _base_inv_freq(rope.theta, dim) / rope.get("factor"), 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, dim), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    return _base_inv_freq(rope.theta, dim), 1.0


class RotaryTable:
    """cos and signed sin per position, computed in float32 once and grown on demand.

    The sin table's first half is negated, so rotating is ``x * cos + swap(x) * sin`` with
    ``swap`` exchanging the halves: the same products as ``rotate_half``, in fewer ops.
    """

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        initial_positions: int,
    ) -> None:
        inv_freq, self._attention_factor = inverse_frequencies(rope, head_dim)
        self._inv_freq = inv_freq.to(device)
        self._dtype = dtype
        self._cos = self._sin = torch.empty(0, head_dim, dtype=dtype, device=device)
        self._grow(initial_positions)

    def _grow(self, num_positions: int) -> None:
        positions = torch.arange(num_positions, dtype=torch.float32, device=self._inv_freq.device)
        freqs = positions[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        sin = angles.sin() * self._attention_factor
        half = sin.shape[-1] // 2
        sin[:, :half] = -sin[:, :half]
        self._cos = (angles.cos() * self._attention_factor).to(self._dtype)
        self._sin = sin.to(self._dtype)

    def lookup(
        self, positions: torch.Tensor, max_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin ``[T, 1, head_dim]`` for ``positions`` (largest: ``max_position``)."""
        if max_position >= self._cos.shape[0]:
            self._grow(max(2 * self._cos.shape[0], max_position + 1))
        return self._cos[positions][:, None], self._sin[positions][:, None]


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by the half-split convention Llama uses; ``out``
    may be ``x`` itself (both terms are computed before it is written)."""
    swapped = x.roll(x.shape[-1] // 2, -1)  # [x2, x1]; the sign is in signed_sin
    return torch.addcmul(x * cos, swapped, signed_sin, out=out)
