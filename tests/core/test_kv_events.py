import dataclasses

import pytest

from kvserve.core.kv_events import EventGapError, EventLog, apply_events


def test_sequence_numbers_start_at_one_without_gaps():
    log = EventLog()
    events = [log.append("stored", "device", [i], None) for i in range(5)]
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    assert log.last_seq == 5
    assert log.since(0) == events
    assert log.since(3) == events[3:]
    assert log.since(5) == []


def test_event_carries_kind_tier_hashes_and_parent():
    log = EventLog()
    event = log.append("stored", "host", [11, 12], 10)
    assert (event.kind, event.tier, event.block_hashes, event.parent_hash) == (
        "stored",
        "host",
        (11, 12),
        10,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.seq = 9  # type: ignore[misc]


def test_subscriber_that_fell_behind_is_told_to_resync():
    log = EventLog(max_history=3)
    for i in range(5):
        log.append("removed", "device", [i])
    assert [e.seq for e in log.since(2)] == [3, 4, 5]
    with pytest.raises(EventGapError, match=r"events 2\.\.2 were dropped"):
        log.since(1)
    with pytest.raises(EventGapError, match="dropped"):
        log.since(0)


def test_subscriber_ahead_of_a_restarted_log_is_told_to_resync():
    log = EventLog()
    log.append("cleared", "device", [])
    with pytest.raises(EventGapError, match="ahead"):
        log.since(7)


def test_rejects_unknown_kind_and_empty_history():
    log = EventLog()
    with pytest.raises(ValueError, match="unknown KV event kind"):
        log.append("evicted", "device", [1])  # type: ignore[arg-type]
    assert log.last_seq == 0
    with pytest.raises(ValueError, match="max_history"):
        EventLog(max_history=0)


def test_apply_events_rebuilds_a_view_and_refuses_what_does_not_fit():
    log = EventLog()
    log.append("stored", "device", [1, 2, 3])
    log.append("stored", "device", [4], 2)
    log.append("removed", "device", [3, 4])
    view: dict[int, int | None] = {}
    apply_events(view, log.since(0))
    assert view == {1: None, 2: 1}
    log.append("cleared", "device", [])
    apply_events(view, log.since(3))
    assert view == {}
    with pytest.raises(EventGapError, match="unknown"):
        apply_events({}, [log.append("stored", "device", [6], 5)])
    with pytest.raises(EventGapError, match="unknown"):
        apply_events({}, [log.append("removed", "device", [7])])


def test_token_ids_are_kept_only_when_the_log_records_them() -> None:
    plain, recording = EventLog(), EventLog(record_tokens=True)
    for log in (plain, recording):
        log.append("stored", "device", [1], None, token_ids=[5, 6, 7, 8])
    assert plain.since(0)[0].token_ids == ()
    assert recording.since(0)[0].token_ids == (5, 6, 7, 8)


def test_events_since_any_kept_point_are_the_log_in_order():
    log = EventLog(max_history=7)
    events = [log.append("stored", "device", [i]) for i in range(20)]
    for seq in range(13, 21):  # every point whose later events the history still holds
        assert log.since(seq) == events[seq:]
