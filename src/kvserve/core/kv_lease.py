"""Reservations of KV blocks that expire: the decode side of a prefill/decode transfer.

A decode worker reserves blocks for a prompt before a prefill worker sends their K/V.
If the sender dies, stalls, or the client goes away and nobody says so, the blocks
must still come back: each reservation is a lease with a deadline, pushed back while
blocks keep arriving, and whatever is past its deadline is handed to the caller to
free. The blocks themselves live in the KV cache manager under the lease's id; this
table only keeps time. Pure: the clock is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Lease:
    lease_id: str
    deadline: float
    ttl: float  # how far each renewal pushes the deadline


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def grant(self, lease_id: str, now: float, ttl: float) -> Lease:
        if ttl <= 0:
            raise ValueError(f"a lease needs a positive ttl, got {ttl}")
        if lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} is held already")
        lease = self._leases[lease_id] = Lease(lease_id, now + ttl, ttl)
        return lease

    def renew(self, lease_id: str, now: float) -> bool:
        """Progress was made: the deadline moves to ``now + ttl``. False if it is gone
        (released, or expired: a late block must then be refused)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.deadline <= now:
            return False
        lease.deadline = now + lease.ttl
        return True

    def release(self, lease_id: str) -> Lease | None:
        """Ends the lease; None if it had ended already (every path may call this)."""
        return self._leases.pop(lease_id, None)

    def expire(self, now: float) -> list[Lease]:
        """Ends and returns every lease whose deadline has passed."""
        expired = [lease for lease in self._leases.values() if lease.deadline <= now]
        for lease in expired:
            del self._leases[lease.lease_id]
        return expired

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self._leases.values()), default=None)


def blocks_to_finish(max_num_tokens: int, held_blocks: int, block_size: int) -> int:
    """Blocks a sequence may still allocate before it reaches its longest length."""
    return max(0, -(-max_num_tokens // block_size) - held_blocks)


def lease_fits(
    available_blocks: int, lease_blocks: int, lease_growth: int, others_growth: int
) -> bool:
    """Whether a decode worker may take a lease of ``lease_blocks`` new blocks whose
    sequence will still grow by ``lease_growth``, when every other sequence it holds,
    waiting or running, leased or not, may still grow by ``others_growth`` in all.

    Leased blocks cannot be preempted, and a sequence handed over with its lease joins
    the queue behind whatever arrived meanwhile: a lease granted only when everything
    already there and the leased sequence itself can reach full length together is one
    that cannot starve the queue ahead of it (the deadlock the simulator found: a long
    local prompt at the head waiting for blocks pinned by the leases queued behind it).
    """
    return available_blocks - lease_blocks - lease_growth >= others_growth
