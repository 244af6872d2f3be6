"""Consistent hashing, for sticky sessions that survive fleet changes.

A key maps to the first worker point clockwise from the key's hash. When a worker joins
or leaves, only the keys on its arcs move; everyone else's session stays put (and with it
their cached conversation).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import xxhash


def _point(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8"))


class HashRing:
    """A ring over a set of workers, rebuilt only when that set changes."""

    def __init__(self, virtual_nodes: int = 160) -> None:
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")
        self._virtual_nodes = virtual_nodes
        self._members: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def lookup(self, key: str, worker_ids: Sequence[str]) -> str:
        """The worker owning ``key`` among ``worker_ids`` (non-empty)."""
        members = tuple(sorted(worker_ids))
        if members != self._members:
            self._build(members)
        index = bisect.bisect_left(self._points, _point(key)) % len(self._points)
        return self._owners[index]

    def _build(self, members: tuple[str, ...]) -> None:
        ring = sorted(
            (_point(f"{worker}#{replica}"), worker)
            for worker in members
            for replica in range(self._virtual_nodes)
        )
        self._members = members
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]
