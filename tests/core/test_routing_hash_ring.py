"""Consistent hashing: stable, balanced, and minimal movement when the fleet changes."""

from __future__ import annotations

from collections import Counter

import pytest

from kvserve.core.routing.hash_ring import HashRing

WORKERS = ["w0", "w1", "w2", "w3"]
KEYS = [f"user-{i}" for i in range(2000)]


def test_lookup_is_deterministic_across_instances() -> None:
    first, second = HashRing(), HashRing()
    assert [first.lookup(k, WORKERS) for k in KEYS] == [second.lookup(k, WORKERS) for k in KEYS]


def test_keys_spread_over_all_workers() -> None:
    ring = HashRing()
    counts = Counter(ring.lookup(k, WORKERS) for k in KEYS)
    assert set(counts) == set(WORKERS)
    assert min(counts.values()) > len(KEYS) / len(WORKERS) * 0.6


def test_removing_a_worker_moves_only_its_keys() -> None:
    ring = HashRing()
    before = {k: ring.lookup(k, WORKERS) for k in KEYS}
    after = {k: ring.lookup(k, ["w0", "w1", "w3"]) for k in KEYS}
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == "w2"}


def test_rejects_zero_virtual_nodes() -> None:
    with pytest.raises(ValueError):
        HashRing(virtual_nodes=0)
