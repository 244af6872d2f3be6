"""The Llama family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache.

The families differ only in flags (biases, q/k norm, windows, RoPE), resolved in
``ModelConfig``. Projections that read the same input are fused at load (q/k/v into one
matrix, gate/up into another) so a layer is a handful of large ops on the whole step's
tokens; at the small hidden sizes of tests and CPU serving, op count dominates time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.engine import paged_kernel
from kvserve.engine.attention import StepLayout, paged_attention
from kvserve.engine.decode_rows import DecodeRows
from kvserve.engine.kv_pool import KVPool
from kvserve.engine.models.linear import GatedUp, Linear
from kvserve.engine.models.rope import RotaryTable, apply_rotary
from kvserve.engine.weights import CheckpointTensors
from kvserve.model_folder.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Over the last dim; a 2-D ``weight`` (Qwen3's stacked per-head norms) broadcasts."""
    if weight.dim() == 1:
        return torch.rms_norm(x, x.shape[-1:], weight, eps)
    return torch.rms_norm(x, x.shape[-1:], None, eps) * weight


@dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    # Qwen3's per-head q and k norms as one [heads + kv_heads, head_dim] weight, so both
    # are normalized in one op on the fused projection.
    qk_norm: torch.Tensor | None
    o: Linear  # its output is added to the residual stream (fused where possible)
    post_norm: torch.Tensor
    gate_up: GatedUp  # silu(gate) * up
    down: Linear  # added to the residual stream too
    window: int | None


def _load_layer(config: ModelConfig, tensors: CheckpointTensors, index: int) -> _Layer:
    prefix = f"model.layers.{index}."
    hidden, head_dim, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    proj_sizes = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
    flags = config.flags

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return tensors.get(prefix + name, shape)

    def fused(names: dict[str, int], module: str, in_dim: int, with_bias: bool) -> Linear:
        weight = torch.cat(
            [get(f"{module}.{n}.weight", (size, in_dim)) for n, size in names.items()]
        )
        bias = (
            torch.cat([get(f"{module}.{n}.bias", (size,)) for n, size in names.items()])
            if with_bias
            else None
        )
        return Linear(weight, bias)

    return _Layer(
        input_norm=get("input_layernorm.weight", (hidden,)),
        qkv=fused(proj_sizes, "self_attn", hidden, flags.qkv_bias),
        qk_norm=_stacked_qk_norm(config, get) if flags.qk_norm else None,
        o=Linear(
            get("self_attn.o_proj.weight", (hidden, q_size)),
            get("self_attn.o_proj.bias", (hidden,)) if flags.o_bias else None,
        ),
        post_norm=get("post_attention_layernorm.weight", (hidden,)),
        gate_up=GatedUp(
            get("mlp.gate_proj.weight", (inter, hidden)),
            get("mlp.up_proj.weight", (inter, hidden)),
            get("mlp.gate_proj.bias", (inter,)) if config.mlp_bias else None,
            get("mlp.up_proj.bias", (inter,)) if config.mlp_bias else None,
        ),
        down=Linear(
            get("mlp.down_proj.weight", (hidden, inter)),
            get("mlp.down_proj.bias", (hidden,)) if config.mlp_bias else None,
        ),
        window=config.sliding_windows[index],
    )


def _stacked_qk_norm(
    config: ModelConfig, get: Callable[[str, tuple[int, ...]], torch.Tensor]
) -> torch.Tensor:
    shape = (config.head_dim,)
    return torch.cat(
        (
            get("self_attn.q_norm.weight", shape).expand(config.num_heads, -1),
            get("self_attn.k_norm.weight", shape).expand(config.num_kv_heads, -1),
        )
    )


class LlamaFamilyModel:
    """Weights plus the forward pass; K/V live in a ``KVPool`` owned by the runner."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: CheckpointTensors,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        vocab_shape = (config.vocab_size, config.hidden_size)
        self.embed = tensors.get("model.embed_tokens.weight", vocab_shape)
        # Like transformers: a checkpoint that ships its own lm_head keeps it, whatever the
        # tie flag says; only an absent one is tied to the embeddings.
        tied = config.tie_word_embeddings and "lm_head.weight" not in tensors
        self.lm_head = Linear(
            self.embed if tied else tensors.get("lm_head.weight", vocab_shape), None
        )
        self.final_norm = tensors.get("model.norm.weight", (config.hidden_size,))
        self.layers = [_load_layer(config, tensors, i) for i in range(config.num_layers)]
        self.rotary = RotaryTable(
            config.rope,
            config.head_dim,
            dtype=dtype,
            device=device,
            initial_positions=min(config.max_position_embeddings, 4096),
        )
        self._scale = config.head_dim**-0.5
        # CPU: the C++ kernels' single-pass RMSNorm and Q/K norm + RoPE (bf16 round on the
        # 1024-wide model: torch's passes were 11% of its CPU time); CUDA keeps torch's ops.
        self._fused = paged_kernel.usable(device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._fused:
            normed: torch.Tensor = torch.ops.kvserve_kernels.rms_norm(
                x, weight, self.config.rms_norm_eps
            )
            return normed
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _rotate_qk(
        self, qkv: torch.Tensor, qk_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Q and K heads of ``qkv`` ``[T, heads + 2 * kv_heads, head_dim]`` normalized (Qwen3)
        and rotated in place: K then sits next to V, as a pool slot stores them."""
        rotated = self.config.num_heads + self.config.num_kv_heads
        if self._fused:
            torch.ops.kvserve_kernels.qk_norm_rope_(
                qkv, qk_norm, cos, sin, rotated, self.config.rms_norm_eps
            )
            return
        qk = qkv[:, :rotated]
        if qk_norm is not None:
            qk = rms_norm(qk, qk_norm, self.config.rms_norm_eps)
        apply_rotary(qk, cos, sin, out=qkv[:, :rotated])

    def forward(
        self,
        token_ids: torch.Tensor,
        layout: StepLayout,
        kv_pool: KVPool,
        decode_rows: DecodeRows,
        max_position: int,
    ) -> torch.Tensor:
        """Hidden states after the final norm for the step's last tokens: ``[num_seqs, hidden]``."""
        config = self.config
        num_tokens, heads, kv_heads = token_ids.shape[0], config.num_heads, config.num_kv_heads
        cos, sin = self.rotary.lookup(layout.positions, max_position)
        hidden = self.embed[token_ids]
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(self._norm(hidden, layer.input_norm))
            qkv = qkv.view(num_tokens, heads + 2 * kv_heads, config.head_dim)
            self._rotate_qk(qkv, layer.qk_norm, cos, sin)
            kv = qkv[:, heads:]
            kv_pool.write(index, layout.slots, kv)
            if layout.row_slots is not None:
                decode_rows.write(index, layout.row_slots, kv[layout.row_token_index])
            attended = paged_attention(
                qkv[:, :heads],
                kv_pool.layer(index),
                decode_rows.layer(index),
                layout,
                window=layer.window,
                scale=self._scale,
            )
            attended = attended.reshape(num_tokens, heads * config.head_dim)
            hidden = layer.o.add_to(hidden, attended)
            x = self._norm(hidden, layer.post_norm)
            hidden = layer.down.add_to(hidden, layer.gate_up(x))
        last = hidden if layout.last_token_index is None else hidden[layout.last_token_index]
        return self._norm(last, self.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
