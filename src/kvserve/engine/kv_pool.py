"""The paged KV cache's memory: one pool of fixed-size blocks per layer.

Which block belongs to which request is decided elsewhere (core.kv_cache_manager); this
module only stores K/V at slots. A token at position ``pos`` of a sequence with block
table ``bt`` lives in slot ``bt[pos // block_size] * block_size + pos % block_size``.
"""

from __future__ import annotations

import torch


class KVPool:
    """Per layer, K and V of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    All layers share one allocation so the whole cache is reserved (or refused) at once.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"KV pool needs positive sizes, got {num_blocks=} {block_size=}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._storage = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * element_size

    def keys(self, layer: int) -> torch.Tensor:
        return self._storage[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self._storage[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` of shape ``[num_tokens, num_kv_heads, head_dim]`` at ``slots``."""
        for pool, new in ((self.keys(layer), k), (self.values(layer), v)):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, new)
