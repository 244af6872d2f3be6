"""KV stores that several workers load from, as the router's index sees them.

A worker announces only its own completed storage writes (``stored``, tier
``storage``), yet every worker attached to the same store can load them. Crediting a
block to its writer alone makes every other member look cold for it, so a policy that
prices loads (kv_aware) sends the request to the writer's queue or recomputes it
elsewhere. The index therefore keeps, per store, which blocks any member vouches for:
each member's storage tier stays its own (its snapshot replaces only what it announced),
and where a member's own match of a prompt ends, the store's run of the blocks after it
continues the match, as the worker itself loads them (device, then host, then storage
from where those end). Blocks the member holds past the store's run are not counted:
its device and host caches keep a block only with its parent, so it rarely has any.

A store is named by the identity its workers report (``storage_id`` in
``/kv/snapshot``: the store's location and the block layout's namespace), so workers
of different models or layouts on one Redis are different stores.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice, takewhile


class SharedStore:
    """One store's members (as mask bits of the index's slots) and the blocks they vouch
    for, each counted once per member whose storage bit for it is set."""

    __slots__ = ("first_bits", "storage_bits", "vouched")

    def __init__(self) -> None:
        self.first_bits = 0  # the first bit of each member's slot
        self.storage_bits = 0  # each member's storage bit
        self.vouched: dict[int, int] = {}  # hash -> members vouching for it

    @property
    def members(self) -> int:
        return self.first_bits.bit_count()

    def join(self, first_bit: int, storage_bit: int, held: Iterable[int]) -> None:
        """A member joins with the storage blocks it announced so far."""
        self.first_bits |= first_bit
        self.storage_bits |= storage_bit
        for block_hash in held:
            self.vouch(block_hash)

    def leave(self, first_bit: int, storage_bit: int, held: Iterable[int]) -> None:
        self.first_bits &= ~first_bit
        self.storage_bits &= ~storage_bit
        for block_hash in held:
            self.unvouch(block_hash)

    def vouch(self, block_hash: int) -> None:
        vouched = self.vouched
        vouched[block_hash] = vouched.get(block_hash, 0) + 1

    def unvouch(self, block_hash: int) -> None:
        vouched = self.vouched
        left = vouched.get(block_hash, 0) - 1
        if left > 0:
            vouched[block_hash] = left
        else:
            vouched.pop(block_hash, None)

    def run(self, block_hashes: Sequence[int], start: int, limit: int) -> int:
        """How many blocks from ``start`` (up to ``limit``) the store holds in a row,
        counted in C."""
        held = self.vouched.__contains__
        return len(list(takewhile(held, islice(block_hashes, start, limit))))
