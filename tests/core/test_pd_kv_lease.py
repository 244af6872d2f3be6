"""Leases on reserved KV blocks: deadlines, renewal by progress, exactly-once endings."""

from __future__ import annotations

import pytest

from kvserve.core.kv_lease import LeaseTable


def test_a_lease_expires_at_its_deadline_and_only_once() -> None:
    table = LeaseTable()
    table.grant("a", now=10.0, ttl=2.0)
    table.grant("b", now=11.0, ttl=2.0)
    assert table.next_deadline() == 12.0
    assert table.expire(11.9) == []
    assert [lease.lease_id for lease in table.expire(12.0)] == ["a"]
    assert table.expire(12.5) == [] and "a" not in table and "b" in table
    assert [lease.lease_id for lease in table.expire(100.0)] == ["b"]
    assert len(table) == 0 and table.next_deadline() is None


def test_progress_pushes_the_deadline_but_cannot_revive_a_lapsed_lease() -> None:
    table = LeaseTable()
    table.grant("a", now=0.0, ttl=1.0)
    assert table.renew("a", now=0.9)
    assert table.expire(1.5) == []  # renewed to 1.9
    assert not table.renew("a", now=1.9)  # at the deadline: too late
    assert [lease.lease_id for lease in table.expire(1.9)] == ["a"]
    assert not table.renew("a", now=1.9)


def test_release_is_idempotent_and_ids_are_unique_while_held() -> None:
    table = LeaseTable()
    table.grant("a", now=0.0, ttl=1.0)
    with pytest.raises(ValueError):
        table.grant("a", now=0.5, ttl=1.0)
    with pytest.raises(ValueError):
        table.grant("b", now=0.0, ttl=0.0)
    assert table.release("a") is not None
    assert table.release("a") is None
    assert table.expire(5.0) == []
    table.grant("a", now=6.0, ttl=1.0)  # the id is free again
    assert "a" in table
