"""The paged KV cache's memory: one pool of fixed-size blocks per layer.

Which block belongs to which request is decided elsewhere (core.kv_cache_manager); this
module only stores K/V at slots. A token at position ``pos`` of a sequence with block
table ``bt`` lives in slot ``bt[pos // block_size] * block_size + pos % block_size``.
"""

from __future__ import annotations

import torch


class KVPool:
    """Per layer one tensor ``[num_blocks, block_size, 2 * num_kv_heads, head_dim]``: K heads
    then V heads of each slot side by side, so one write stores both and one gather by
    block table reads both (the step's cost is mostly op count, not bytes).

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
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self._storage = torch.zeros(
            (num_layers, num_blocks, block_size, 2 * num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )
        # Views made once: a step touches every layer, and each view costs a dispatch.
        self._layers = list(self._storage.unbind(0))
        self._slot_views = [layer.view(-1, *layer.shape[2:]) for layer in self._layers]

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * element_size

    @property
    def nbytes(self) -> int:
        return self._storage.nbytes

    def layer(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, 2 * num_kv_heads, head_dim]``, K heads first."""
        return self._layers[layer]

    def keys(self, layer: int) -> torch.Tensor:
        return self._layers[layer][:, :, : self.num_kv_heads]

    def values(self, layer: int) -> torch.Tensor:
        return self._layers[layer][:, :, self.num_kv_heads :]

    def gather_all_layers(self, block_ids: torch.Tensor) -> torch.Tensor:
        """``[num_layers, len(block_ids), block_size, 2 * num_kv_heads, head_dim]``, a copy."""
        return self._storage.index_select(1, block_ids)

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv`` ``[num_tokens, 2 * num_kv_heads, head_dim]`` (K heads, then V) at
        ``slots``."""
        self._slot_views[layer].index_copy_(0, slots, kv)
