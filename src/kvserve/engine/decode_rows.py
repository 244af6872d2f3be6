"""Contiguous K/V rows for sequences that decode step after step.

Without a paged attention kernel, every decode step would gather each sequence's blocks
into one padded tensor, per layer: a copy of the whole context, as costly as attention
itself (both are memory-bound). A sequence that decodes in consecutive steps keeps a
contiguous copy of its K/V here instead, filled from the pool once and then extended by
its one new token per step, so a decode step reads each context once.

The pool stays the source of truth (prefix cache, KV export, preemption). A row lives
only while its sequence decodes in consecutive steps and is refilled whenever the
sequence's position is not the one the row expects, so pool blocks rewritten between
steps (a recompute, a KV transfer) never leave it stale.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvserve.engine.kv_pool import KVPool

_GROWTH = 1.5  # rows and row length grow geometrically: few reallocations


@dataclass(frozen=True, slots=True)
class RowPlacement:
    """Rows ``[0, len(rows))`` are the step's decoding items, item ``i`` in ``rows[i]``."""

    rows: list[int]
    # (row, position) of each item's new token: where its K/V go in a layer.
    write_index: tuple[torch.Tensor, torch.Tensor]


class DecodeRows:
    """Per layer ``[row, 2 * kv_heads, position, head_dim]``: each head's keys (and values)
    of a row are contiguous, the layout attention reads fastest. Rows in use are always
    ``[0, number of decoding items)``, with no holes. Memory is capped at ``max_bytes``; a
    step that would need more gets no placement and attends over gathered blocks."""

    def __init__(self, pool: KVPool, max_bytes: int) -> None:
        self._pool = pool
        self._max_bytes = max_bytes
        self._block_size = pool.block_size
        layer = pool.layer(0)  # [num_blocks, block_size, 2 * kv_heads, head_dim]
        self._num_heads, self._head_dim = layer.shape[2], layer.shape[3]
        self._bytes_per_position = pool.num_layers * layer[0, 0].numel() * layer.element_size()
        self._storage = layer.new_zeros((pool.num_layers, 0, self._num_heads, 0, self._head_dim))
        self._row_of: dict[Hashable, int] = {}
        self._row_length: dict[int, int] = {}  # tokens in each row in use

    @property
    def row_capacity(self) -> int:
        return self._storage.shape[1]

    @property
    def row_length_capacity(self) -> int:
        return self._storage.shape[3]

    def layer(self, layer: int) -> torch.Tensor:
        """``[row_capacity, 2 * kv_heads, row_length_capacity, head_dim]``."""
        return self._storage[layer]

    def write(
        self, layer: int, write_index: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor
    ) -> None:
        """Store ``kv`` ``[num_items, 2 * kv_heads, head_dim]`` (may be strided) at
        ``write_index``."""
        self._storage[layer].transpose(1, 2).index_put_(write_index, kv)

    def clear(self) -> None:
        """Forget every row (after a failed step, whose writes may be partial)."""
        self._row_of.clear()
        self._row_length.clear()

    def place(
        self,
        keys: Sequence[Hashable | None],
        starts: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> RowPlacement | None:
        """Rows for one step's decoding items, each computing the token at ``starts[i]``.

        Rows of sequences absent from this step are released. An item keeps its row when
        it holds exactly ``starts[i]`` tokens (moved down if it sits above the rows in use);
        otherwise (new, resumed, ``None`` key) a row is filled from the pool. Returns
        ``None``, holding no rows, when there are no items or they would not fit."""
        count = len(keys)
        if not count or not self._reserve(count, max(starts) + 1):
            self.clear()
            return None
        kept: list[int | None] = []
        for key, start in zip(keys, starts, strict=True):
            row = self._row_of.pop(key, None) if key is not None else None
            kept.append(row if row is not None and self._row_length[row] == start else None)
        in_place = {row for row in kept if row is not None and row < count}
        free = iter(sorted(set(range(count)) - in_place))
        rows = [row if row is not None and row < count else next(free) for row in kept]
        moves = [(row, rows[i]) for i, row in enumerate(kept) if row is not None and row >= count]
        if moves:
            sources, targets = zip(*moves, strict=True)
            self._storage[:, list(targets)] = self._storage[:, list(sources)]
        self._fill([i for i, row in enumerate(kept) if row is None], rows, starts, block_tables)
        self._row_of = {key: row for key, row in zip(keys, rows, strict=True) if key is not None}
        self._row_length = {row: start + 1 for row, start in zip(rows, starts, strict=True)}
        return RowPlacement(rows, self._write_index(rows, starts))

    def _write_index(
        self, rows: list[int], starts: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor([rows, starts], dtype=torch.long, device=self._storage.device)
        return index[0], index[1]

    def _reserve(self, num_rows: int, row_length: int) -> bool:
        """Grow the storage to hold ``num_rows`` rows of ``row_length`` tokens."""
        # Whole blocks: a row is filled a pool block at a time.
        row_length = -(-row_length // self._block_size) * self._block_size
        have_rows, have_length = self.row_capacity, self.row_length_capacity
        if num_rows <= have_rows and row_length <= have_length:
            return True
        shapes = [
            (
                _grown(num_rows, have_rows, growth),
                _grown(row_length, have_length, growth, self._block_size),
            )
            for growth in (_GROWTH, 1.0)  # geometric if that fits, else just what is needed
        ]
        for rows, length in shapes:
            if rows * length * self._bytes_per_position <= self._max_bytes:
                # Zeros, not empty: masked keys still meet their values (0 * NaN is NaN).
                grown = self._storage.new_zeros(
                    (self._storage.shape[0], rows, self._num_heads, length, self._head_dim)
                )
                grown[:, :have_rows, :, :have_length] = self._storage
                self._storage = grown
                return True
        return False

    def _fill(
        self,
        items: list[int],
        rows: list[int],
        starts: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> None:
        """Copy the cached tokens of each listed item's sequence from the pool into its row."""
        block_size = self._block_size
        used = {i: -(-starts[i] // block_size) for i in items}
        sources = [block for i in items for block in block_tables[i][: used[i]]]
        if not sources:
            return
        index = torch.tensor(sources, dtype=torch.long, device=self._storage.device)
        blocks = self._pool.gather_all_layers(index)  # [L, n, block_size, heads, head_dim]
        first = 0
        for i in items:
            length = used[i] * block_size
            run = blocks[:, first : first + used[i]].flatten(1, 2)  # [L, length, heads, dim]
            self._storage[:, rows[i], :, :length] = run.transpose(1, 2)
            first += used[i]


def _grown(needed: int, have: int, growth: float, multiple: int = 1) -> int:
    """``have`` when it suffices, else at least ``have * growth``, a multiple of ``multiple``."""
    if needed <= have:
        return have
    return -(-max(needed, int(have * growth)) // multiple) * multiple
