"""Attention over a paged KV cache, for a step that mixes prefill chunks and decodes.

The step's new tokens are one flat sequence (so projections and MLPs run as one matmul).
For attention, sequences are grouped by query length — decodes (one query each) in one
group, prefill chunks in the other — and each group runs as one padded, masked SDPA call
over K/V gathered by block tables. Grouping keeps a long prefill chunk from padding every
decode's query to its length; everything here is built once per step and reused by all
layers, so no layer loops over sequences in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class SequenceSpan:
    """One sequence's share of a step: ``num_new`` tokens after ``start_pos`` cached ones."""

    start_pos: int
    num_new: int
    block_table: Sequence[int]


@dataclass(frozen=True, slots=True)
class _Group:
    query_index: torch.Tensor  # [B, Q] flat token index of each padded query (pads repeat)
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0 (masked out)
    valid: torch.Tensor  # [B, Q] which padded queries are real tokens
    flat_valid_index: torch.Tensor  # flat token index of each real query, in valid order
    masks: dict[int | None, torch.Tensor]  # window → [B, 1, Q, K] bool, True = attend


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Where each new token goes and what it may attend to; shared by all layers."""

    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] KV pool slot of each new token
    last_token_index: torch.Tensor  # [num_sequences] flat index of each sequence's last token
    groups: tuple[_Group, ...]

    @classmethod
    def build(
        cls,
        spans: Sequence[SequenceSpan],
        *,
        block_size: int,
        windows: set[int | None],
        device: torch.device,
    ) -> StepLayout:
        positions: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []
        for span in spans:
            offsets.append(len(positions))
            for pos in range(span.start_pos, span.start_pos + span.num_new):
                positions.append(pos)
                slots.append(span.block_table[pos // block_size] * block_size + pos % block_size)
        last = [offset + span.num_new - 1 for offset, span in zip(offsets, spans, strict=True)]
        decode = [i for i, span in enumerate(spans) if span.num_new == 1]
        prefill = [i for i, span in enumerate(spans) if span.num_new > 1]
        groups = tuple(
            _build_group(
                [spans[i] for i in members],
                [offsets[i] for i in members],
                block_size=block_size,
                windows=windows,
                device=device,
            )
            for members in (decode, prefill)
            if members
        )
        return cls(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            last_token_index=torch.tensor(last, dtype=torch.long, device=device),
            groups=groups,
        )


def _build_group(
    spans: list[SequenceSpan],
    offsets: list[int],
    *,
    block_size: int,
    windows: set[int | None],
    device: torch.device,
) -> _Group:
    max_new = max(span.num_new for span in spans)
    max_blocks = max(-(-(span.start_pos + span.num_new) // block_size) for span in spans)
    query_index, query_pos, valid, tables = [], [], [], []
    for span, offset in zip(spans, offsets, strict=True):
        # A pad query repeats the sequence's last token, so its mask row is never empty.
        steps = [min(q, span.num_new - 1) for q in range(max_new)]
        query_index.append([offset + s for s in steps])
        query_pos.append([span.start_pos + s for s in steps])
        valid.append([q < span.num_new for q in range(max_new)])
        used = -(-(span.start_pos + span.num_new) // block_size)
        tables.append(list(span.block_table[:used]) + [0] * (max_blocks - used))
    as_long = {"dtype": torch.long, "device": device}
    query_index_t = torch.tensor(query_index, **as_long)
    query_pos_t = torch.tensor(query_pos, **as_long)
    valid_t = torch.tensor(valid, dtype=torch.bool, device=device)
    key_pos = torch.arange(max_blocks * block_size, **as_long)
    delta = query_pos_t[:, :, None] - key_pos[None, None, :]  # [B, Q, K]; >= 0 is causal
    masks = {
        window: ((delta >= 0) if window is None else (delta >= 0) & (delta < window))[:, None]
        for window in windows
    }
    return _Group(
        query_index=query_index_t,
        block_tables=torch.tensor(tables, **as_long),
        valid=valid_t,
        flat_valid_index=query_index_t[valid_t],
        masks=masks,
    )


def paged_attention(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    layout: StepLayout,
    *,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """``q``: ``[T, num_heads, head_dim]`` for the step's new tokens, whose K/V are already
    in the pools (``[num_blocks, block_size, num_kv_heads, head_dim]``). Returns the
    attention output ``[T, num_heads, head_dim]``."""
    out = torch.empty_like(q)
    for group in layout.groups:
        keys = key_pool[group.block_tables].flatten(1, 2).transpose(1, 2)  # [B, KVH, K, D]
        values = value_pool[group.block_tables].flatten(1, 2).transpose(1, 2)
        queries = q[group.query_index].transpose(1, 2)  # [B, H, Q, D]
        attended = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=group.masks[window],
            scale=scale,
            enable_gqa=True,
        )
        out[group.flat_valid_index] = attended.transpose(1, 2)[group.valid]
    return out
