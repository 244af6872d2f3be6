"""Attention over a paged KV cache, for a step that mixes prefill chunks and decodes.

The step's new tokens are one flat sequence (so projections and MLPs run as one matmul).
For attention, sequences are grouped by query length — decodes (one query each) in one
group, prefill chunks in the other — and each group runs as one padded, masked SDPA call
over K/V gathered by block tables. Grouping keeps a long prefill chunk from padding every
decode's query to its length; everything here is built once per step and reused by all
layers, so no layer loops over sequences in Python.

For decodes, grouped-query attention is folded rather than expanded: the query heads that
share a KV head become that head's query rows (``[B, kv_heads, group, D]``), so K/V are
never repeated and no transposes are needed. Prefill chunks use SDPA's own GQA support,
which keeps the mask at ``[B, 1, Q, K]`` instead of growing with the group size.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.engine.decode_rows import RowPlacement


def long_tensor(values: array[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor from an ``array('q')``: several times faster than ``torch.tensor`` on
    a list, which matters at one step per generated token."""
    if not values:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(values, dtype=torch.long).to(device)


@dataclass(frozen=True, slots=True)
class SequenceSpan:
    """One sequence's share of a step: ``num_new`` tokens after ``start_pos`` cached ones."""

    start_pos: int
    num_new: int
    block_table: Sequence[int]


@dataclass(frozen=True, slots=True)
class _Group:
    batch: int  # B: sequences (or decode rows) attended together
    num_queries: int  # Q: padded query length of every sequence in the group
    num_keys: int  # K: padded key length
    # [B, max_blocks] padded with block 0 (masked out); None: K/V come from decode rows.
    block_tables: torch.Tensor | None
    # Where each layer gathers the group's K/V blocks: allocated once per step, not per layer.
    kv_scratch: torch.Tensor | None  # [B * max_blocks, *kv_block_shape]
    # window → additive [B, 1, Q, K], or None where SDPA's is_causal says the same
    masks: dict[int | None, torch.Tensor | None]
    # None when the group is the whole step in flat order with no padding (e.g. all
    # decodes): its queries and outputs are then plain views of the step's tensors.
    # [B * Q] flat token index of each padded query (a slice when they are one run)
    query_index: torch.Tensor | slice | None
    valid: torch.Tensor | None  # [B * Q] which padded queries are real tokens; None: all
    flat_valid_index: torch.Tensor | slice | None  # flat token index of each real query


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Where each new token goes and what it may attend to; shared by all layers."""

    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] KV pool slot of each new token
    # [num_sequences] flat index of each sequence's last token; None: every token is one
    last_token_index: torch.Tensor | None
    groups: tuple[_Group, ...]
    # Decode tokens whose K/V also go to their decode rows: row slots, and which tokens
    # (a slice when they are the step's first ones, as the scheduler puts decodes first).
    row_slots: tuple[torch.Tensor, torch.Tensor] | None  # (row, position) per decode token
    row_token_index: torch.Tensor | slice
    # For the in-place kernel (then ``groups`` is empty): block tables [N, max_blocks] and
    # per sequence (start_pos, num_new, flat index of its first token) [N, 3].
    in_place: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        spans: Sequence[SequenceSpan],
        *,
        block_size: int,
        kv_block_shape: tuple[int, ...],
        windows: set[int | None],
        dtype: torch.dtype,
        device: torch.device,
        rows: RowPlacement | None = None,
        in_place: bool = False,
    ) -> StepLayout:
        """Python touches each sequence once and each of its blocks once, never each token:
        positions and slots are appended a block's run at a time. ``rows``: where the
        single-token spans (in order) attend from, if they use decode rows. ``in_place``:
        attention runs as the paged kernel, which reads the pool itself (no groups)."""
        counts = [span.num_new for span in spans]
        used_blocks = [-(-(span.start_pos + span.num_new) // block_size) for span in spans]
        all_single = max(counts) == 1
        # Block tables are only read by groups that gather: not by decodes in rows.
        width = 0 if rows is not None and all_single else max(used_blocks)
        padded_tables, positions, slots = array("q"), array("q"), array("q")
        per_sequence = array("q", [span.start_pos for span in spans] + counts)
        offset, flat_offsets = 0, []
        for span, used in zip(spans, used_blocks, strict=True):
            table, start = span.block_table, span.start_pos
            if width:
                padded_tables.extend(table[:used])
                if used < width:
                    padded_tables.frombytes(bytes(8 * (width - used)))  # int64 zeros
            if span.num_new == 1:  # the common decode case, without the block loop
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                end = start + span.num_new
                positions.extend(range(start, end))
                for block_index in range(start // block_size, used):
                    first = max(start, block_index * block_size)
                    last = min(end, (block_index + 1) * block_size)
                    base = (table[block_index] - block_index) * block_size
                    slots.extend(range(base + first, base + last))
            per_sequence.append(offset)
            flat_offsets.append(offset)
            offset += span.num_new
        tables = long_tensor(padded_tables, device).view(len(spans), width)
        starts, num_new, offsets = long_tensor(per_sequence, device).view(3, -1)
        if in_place:
            return cls(
                positions=long_tensor(positions, device),
                slots=long_tensor(slots, device),
                last_token_index=None if all_single else offsets + num_new - 1,
                groups=(),
                row_slots=None,
                row_token_index=slice(0),
                in_place=(tables, torch.stack((starts, num_new, offsets), dim=1)),
            )
        step = _StepTensors(tables, starts, num_new, offsets)
        decode = [i for i, count in enumerate(counts) if count == 1]
        members_of_groups = ([decode] if decode else []) + _prefill_groups(spans)
        whole_step = len(members_of_groups) == 1
        groups = tuple(
            _build_rows_group(
                [flat_offsets[i] for i in decode],
                [spans[i].start_pos for i in decode],
                rows,
                whole_step=whole_step,
                windows=windows,
                dtype=dtype,
                device=device,
            )
            if rows is not None and members is decode
            else _build_group(
                step,
                None if whole_step else members,
                flat_range=_flat_range(members, counts, flat_offsets),
                num_queries=max(counts[i] for i in members),
                num_blocks=max(used_blocks[i] for i in members),
                uniform=len({counts[i] for i in members}) == 1,
                from_start=all(spans[i].start_pos == 0 for i in members),
                block_size=block_size,
                kv_block_shape=kv_block_shape,
                windows=windows,
                dtype=dtype,
            )
            for members in members_of_groups
        )
        row_slots = None
        row_token_index: slice | torch.Tensor = slice(0)
        if rows is not None:
            row_slots = rows.write_index
            first_tokens = decode == list(range(len(decode)))
            row_token_index = (
                slice(len(decode))
                if first_tokens
                else long_tensor(array("q", (flat_offsets[i] for i in decode)), device)
            )
        return cls(
            positions=long_tensor(positions, device),
            slots=long_tensor(slots, device),
            last_token_index=None if all_single else offsets + num_new - 1,
            groups=groups,
            row_slots=row_slots,
            row_token_index=row_token_index,
        )


@dataclass(frozen=True, slots=True)
class _StepTensors:
    """Per-sequence facts of the step, one row per sequence."""

    tables: torch.Tensor  # [N, max_blocks]
    starts: torch.Tensor  # [N]
    num_new: torch.Tensor  # [N]
    offsets: torch.Tensor  # [N] flat index of each sequence's first new token


# More prefill chunks than this that resume cached sequences share one padded group:
# one SDPA call per layer for all of them beats many small calls.
_MAX_SINGLE_PREFILL_GROUPS = 4


def _prefill_groups(spans: Sequence[SequenceSpan]) -> list[list[int]]:
    """Multi-token spans grouped so that little attention is padding: spans from position
    0 with equal lengths together (plain causal, no padding), every other span alone (a
    chunk after cached tokens needs a mask, but then no padded queries) unless there are
    many, which then share one padded group."""
    from_start: dict[int, list[int]] = {}
    resumed: list[int] = []
    for i, span in enumerate(spans):
        if span.num_new > 1:
            if span.start_pos == 0:
                from_start.setdefault(span.num_new, []).append(i)
            else:
                resumed.append(i)
    if len(resumed) > _MAX_SINGLE_PREFILL_GROUPS:
        return [*from_start.values(), resumed]
    return [*from_start.values(), *([i] for i in resumed)]


def _flat_range(members: list[int], counts: list[int], flat_offsets: list[int]) -> slice | None:
    """The step's tokens of ``members`` as one slice, when they are consecutive sequences of
    equal length (so the group's queries are a plain view, with no padding)."""
    first, last = members[0], members[-1]
    if last - first + 1 != len(members) or len({counts[i] for i in members}) != 1:
        return None
    return slice(flat_offsets[first], flat_offsets[last] + counts[last])


def _build_group(
    step: _StepTensors,
    members: list[int] | None,
    *,
    flat_range: slice | None,
    num_queries: int,
    num_blocks: int,
    uniform: bool,
    from_start: bool,
    block_size: int,
    kv_block_shape: tuple[int, ...],
    windows: set[int | None],
    dtype: torch.dtype,
) -> _Group:
    """``members`` None: the group is every sequence of the step, in order. ``uniform``: all
    have ``num_queries`` new tokens; ``from_start``: none has cached tokens. ``flat_range``:
    the group's tokens, when they are one unpadded run of the step's."""
    tables, starts, num_new, offsets = step.tables, step.starts, step.num_new, step.offsets
    if members is not None:
        rows: slice | torch.Tensor = (
            slice(members[0], members[-1] + 1)
            if flat_range is not None
            else torch.tensor(members, dtype=torch.long, device=tables.device)
        )
        tables, starts, num_new, offsets = tables[rows], starts[rows], num_new[rows], offsets[rows]
    device = tables.device
    num_keys = num_blocks * block_size
    query_steps = torch.arange(num_queries, device=device)
    # A pad query repeats its sequence's last token, so no mask row is empty.
    clamped = torch.minimum(query_steps[None, :], num_new[:, None] - 1)  # [B, Q]
    masks: dict[int | None, torch.Tensor | None] = {}
    for window in windows:
        if num_queries > 1 and uniform and from_start and (window is None or window >= num_keys):
            # Plain causal attention from position 0: SDPA's is_causal (top-left aligned)
            # masks the padding keys too, and skips the blocks above the diagonal.
            masks[window] = None
        else:
            masks[window] = _additive_mask(starts[:, None] + clamped, num_keys, window, dtype)
    query_index: torch.Tensor | slice | None = None
    flat_valid_index: torch.Tensor | slice | None = None
    valid: torch.Tensor | None = None
    if members is not None and flat_range is not None:
        query_index = flat_valid_index = flat_range
    elif members is not None or not uniform:
        padded_index = (offsets[:, None] + clamped).view(-1)
        valid = (query_steps[None, :] < num_new[:, None]).view(-1)
        query_index, flat_valid_index = padded_index, padded_index[valid]
    return _Group(
        batch=tables.shape[0],
        num_queries=num_queries,
        num_keys=num_keys,
        block_tables=tables[:, :num_blocks].contiguous(),
        kv_scratch=torch.empty(
            (tables.shape[0] * num_blocks, *kv_block_shape), dtype=dtype, device=device
        ),
        masks=masks,
        query_index=query_index,
        valid=valid,
        flat_valid_index=flat_valid_index,
    )


def _build_rows_group(
    flat_offsets: list[int],
    starts: list[int],
    placement: RowPlacement,
    *,
    whole_step: bool,
    windows: set[int | None],
    dtype: torch.dtype,
    device: torch.device,
) -> _Group:
    """Single-token spans attending over their decode rows: row ``r`` of the attention
    batch is decode row ``r``."""
    count = len(starts)
    query_of_row, position_of_row = [0] * count, [0] * count
    for offset, start, row in zip(flat_offsets, starts, placement.rows, strict=True):
        query_of_row[row], position_of_row[row] = offset, start
    positions = long_tensor(array("q", position_of_row), device)
    num_keys = max(starts) + 1
    query_index = None
    if not (whole_step and placement.rows == list(range(count))):
        query_index = long_tensor(array("q", query_of_row), device)
    return _Group(
        batch=count,
        num_queries=1,
        num_keys=num_keys,
        block_tables=None,
        kv_scratch=None,
        masks={
            window: _additive_mask(positions[:, None], num_keys, window, dtype)
            for window in windows
        },
        query_index=query_index,
        valid=None,
        flat_valid_index=query_index,
    )


def _additive_mask(
    query_positions: torch.Tensor, num_keys: int, window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """``[B, 1, Q, K]``: 0 where query position ``[B, Q]`` may see key ``k``, else -inf."""
    key_positions = torch.arange(num_keys, device=query_positions.device)
    query_positions = query_positions[:, :, None]
    blocked = key_positions > query_positions  # [B, Q, K]; one comparison, no [B, Q, K] ints
    if window is not None:
        blocked |= key_positions <= query_positions - window
    additive = torch.zeros(blocked.shape, dtype=dtype, device=query_positions.device)
    return additive.masked_fill_(blocked, float("-inf"))[:, None]


def paged_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    kv_rows: torch.Tensor,
    layout: StepLayout,
    *,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """``q``: ``[T, num_heads, head_dim]`` for the step's new tokens, whose K/V are already
    in ``kv_pool`` (``[num_blocks, block_size, 2 * num_kv_heads, head_dim]``) and, for
    decodes placed in rows, in ``kv_rows`` (``[rows, 2 * num_kv_heads, positions,
    head_dim]``). Returns the attention output ``[T, num_heads, head_dim]``."""
    if layout.in_place is not None:
        tables, sequences = layout.in_place
        in_place: torch.Tensor = torch.ops.kvserve_kernels.paged_attention(
            q, kv_pool, tables, sequences, window or 0, scale
        )
        return in_place
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[2] // 2
    out = None
    for group in layout.groups:
        batch, num_queries = group.batch, group.num_queries
        if group.block_tables is None:
            kv = kv_rows[:batch, :, : group.num_keys]  # [B, 2*KVH, K, D]
        else:
            # index_select on the flat block axis is a row copy; advanced indexing of the
            # 4-D pool is several times slower.
            kv = torch.index_select(
                kv_pool, 0, group.block_tables.view(-1), out=group.kv_scratch
            ).view(batch, -1, *kv_pool.shape[2:])
            kv = kv.transpose(1, 2)  # [B, 2*KVH, K, D]
        keys, values = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
        queries = q if group.query_index is None else q[group.query_index]
        if num_queries == 1:
            # Fold the query heads sharing a KV head into its query rows: [B, KVH, G, D].
            queries = queries.view(batch, num_kv_heads, -1, head_dim)
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=group.masks[window], scale=scale
            ).reshape(batch, num_heads, head_dim)  # a view unless the kernel's output is strided
        else:
            queries = queries.view(batch, num_queries, num_heads, head_dim).transpose(1, 2)
            mask = group.masks[window]
            attended = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            attended = attended.transpose(1, 2).reshape(batch * num_queries, num_heads, head_dim)
        if group.query_index is None:
            return attended
        if out is None:
            out = torch.empty_like(q)
        out[group.flat_valid_index] = attended if group.valid is None else attended[group.valid]
    if out is None:
        raise ValueError("the attention layout has no groups")
    return out
