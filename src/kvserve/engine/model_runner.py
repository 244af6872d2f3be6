"""One forward step of a model over the paged KV cache: the engine's only torch boundary.

The scheduler decides which tokens run; the runner turns them into logits, writing each
new token's K/V into the slots its block table names. Prefill chunks and decodes of many
sequences share one forward.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvserve.engine import paged_kernel
from kvserve.engine.attention import SequenceSpan, StepLayout, long_tensor
from kvserve.engine.decode_rows import DecodeRows
from kvserve.engine.device import pick_device, pick_dtype
from kvserve.engine.host_allocator import keep_freed_memory
from kvserve.engine.kv_pool import KVPool
from kvserve.engine.models import MODEL_CLASSES
from kvserve.engine.thread_governor import governor_for
from kvserve.engine.weights import CheckpointTensors
from kvserve.model_folder.config import ModelConfig


@dataclass
class SequenceBatchItem:
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # tokens already in the KV cache for this sequence
    block_table: list[int]  # covers start_pos + len(token_ids) tokens
    # Names the sequence across steps (e.g. its request), so that while it decodes step
    # after step its K/V stay in a contiguous decode row; None: gathered afresh each step.
    sequence_key: Hashable | None = None
    # Logits of every token computed this step, not only the last (prompt logprobs).
    all_logits: bool = False


# Decode rows may use this much memory beyond the pool (a copy of the decoding contexts),
# on CPU only: there the per-step gather of every context is memory-bound and host memory
# is plentiful, while an accelerator's pool is sized to fill its memory and gathers fast.
DECODE_ROWS_MEMORY_FRACTION = 0.25


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        num_blocks: int,
        block_size: int,
        device: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.config = ModelConfig.from_dir(model_dir)
        self.device = pick_device(device)
        self.dtype = pick_dtype(self.config, self.device, dtype)
        if self.device.type == "cpu":  # activations live in host memory only there
            keep_freed_memory()
        tensors = CheckpointTensors(model_dir, dtype=self.dtype, device=self.device)
        model_class = MODEL_CLASSES[self.config.architecture]
        self.model = model_class(self.config, tensors, dtype=self.dtype, device=self.device)
        self.block_size = block_size
        self.kv_pool = KVPool(
            num_layers=self.config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._windows = set(self.config.sliding_windows)
        # The paged kernel reads K/V in place, so decodes need no contiguous rows either.
        self._in_place = paged_kernel.usable(self.device)
        rows_fraction = (
            DECODE_ROWS_MEMORY_FRACTION if self.device.type == "cpu" and not self._in_place else 0.0
        )
        self.decode_rows = DecodeRows(
            self.kv_pool, max_bytes=int(rows_fraction * self.kv_pool.nbytes)
        )
        # On CPU: threads that spin through a step while the cores are the engine's alone,
        # and barely while other jobs want them (None: nothing to govern)
        self.thread_governor = governor_for(self.device)

    def intra_op_threads(self) -> tuple[int, bool, int]:
        """The model's intra-op threads, whether their waits are short now (the cores
        shared with other jobs), and how many times the governor changed that (for the
        worker's metrics)."""
        governor = self.thread_governor
        if governor is None:
            return torch.get_num_threads(), False, 0
        return torch.get_num_threads(), governor.throttled, governor.changes

    @staticmethod
    def blocks_for_memory(
        config: ModelConfig, block_size: int, num_bytes: int, dtype: torch.dtype
    ) -> int:
        """How many KV blocks fit in ``num_bytes``."""
        per_block = KVPool.bytes_per_block(
            num_layers=config.num_layers,
            block_size=block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype,
        )
        return num_bytes // per_block

    @torch.inference_mode()
    def forward(self, batch: list[SequenceBatchItem]) -> torch.Tensor:
        """Float32 logits of each item's last new token, in batch order; an item with
        ``all_logits`` contributes one row per new token instead: ``[rows, vocab_size]``
        (``[len(batch), vocab_size]`` when no item asks for all)."""
        self._check(batch)
        governor = self.thread_governor
        if governor is None:
            return self._forward(batch)
        governor.step_started()
        try:
            return self._forward(batch)
        finally:
            governor.step_ended()

    def _forward(self, batch: list[SequenceBatchItem]) -> torch.Tensor:
        decoding = [item for item in batch if len(item.token_ids) == 1]
        rows = (
            None
            if self._in_place
            else self.decode_rows.place(
                [item.sequence_key for item in decoding],
                [item.start_pos for item in decoding],
                [item.block_table for item in decoding],
            )
        )
        spans = [
            SequenceSpan(item.start_pos, len(item.token_ids), item.block_table) for item in batch
        ]
        layout = StepLayout.build(
            spans,
            block_size=self.block_size,
            kv_block_shape=self.kv_pool.layer(0).shape[1:],
            windows=self._windows,
            dtype=self.dtype,
            device=self.device,
            rows=rows,
            in_place=self._in_place,
        )
        if any(item.all_logits for item in batch):
            layout = replace(layout, last_token_index=_output_index(batch, self.device))
        token_ids = array("q")
        for item in batch:
            token_ids.extend(item.token_ids)
        max_position = max(item.start_pos + len(item.token_ids) for item in batch) - 1
        try:
            hidden = self.model.forward(
                long_tensor(token_ids, self.device),
                layout,
                self.kv_pool,
                self.decode_rows,
                max_position,
            )
        except BaseException:
            self.decode_rows.clear()  # rows may hold some layers' new token, not others'
            raise
        return self.model.logits(hidden)

    def _check(self, batch: list[SequenceBatchItem]) -> None:
        """Reject what would otherwise write K/V into another sequence's block or crash
        inside torch with an unhelpful message."""
        if not batch:
            raise ValueError("forward needs at least one sequence")
        for item in batch:
            if not item.token_ids or item.start_pos < 0:
                raise ValueError(
                    f"bad batch item: {len(item.token_ids)} tokens at {item.start_pos}"
                )
            needed = -(-(item.start_pos + len(item.token_ids)) // self.block_size)
            if len(item.block_table) < needed:
                raise ValueError(f"block table has {len(item.block_table)} blocks, {needed} needed")
            used = item.block_table[:needed]
            if min(used) < 0 or max(used) >= self.kv_pool.num_blocks:
                raise ValueError(f"block id out of range [0, {self.kv_pool.num_blocks})")
            if min(item.token_ids) < 0 or max(item.token_ids) >= self.config.vocab_size:
                raise ValueError(f"token id out of range [0, {self.config.vocab_size})")


def _output_index(batch: list[SequenceBatchItem], device: torch.device) -> torch.Tensor:
    """Flat indexes of the tokens whose logits ``forward`` returns."""
    index = array("q")
    offset = 0
    for item in batch:
        count = len(item.token_ids)
        index.extend(range(offset, offset + count) if item.all_logits else (offset + count - 1,))
        offset += count
    return long_tensor(index, device)
