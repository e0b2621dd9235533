"""What needs no broker: ids, times, events, deduplication."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import pytest

from sas_saga_client import StatusEvent, uuid7
from sas_saga_client.events import Seen, format_time, parse_time


def test_uuid7_has_version_7_the_variant_and_increases():
    ids = [uuid7() for _ in range(5000)]
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    assert ids == sorted(ids, key=lambda i: i.int)
    assert len(set(ids)) == len(ids)
    ms = ids[0].int >> 80
    now = int(datetime.now(timezone.utc).timestamp() * 1000)
    assert abs(now - ms) < 60_000


def test_times_read_and_write_rfc3339_in_utc():
    at = parse_time("2026-11-21T10:00:00.123456789Z")
    assert at == datetime(2026, 11, 21, 10, 0, 0, 123456, tzinfo=timezone.utc)
    assert parse_time("2026-11-21T12:00:00+02:00") == datetime(2026, 11, 21, 10, tzinfo=timezone.utc)
    assert format_time(at) == "2026-11-21T10:00:00.123456Z"
    with pytest.raises(ValueError):
        parse_time("yesterday")
    with pytest.raises(ValueError):
        format_time(datetime(2026, 1, 1))


def test_a_status_event_is_read_and_an_unknown_state_kept():
    e = StatusEvent.from_json(
        b'{"order_id":"x","seq":3,"state":"step_paused","step":"a","attempt":1,'
        b'"at":"2026-11-21T10:00:00Z","detail":{"k":1},"new_field":true}'
    )
    assert (e.order_id, e.seq, e.state, e.step, e.attempt) == ("x", 3, "step_paused", "a", 1)
    assert e.detail == {"k": 1}
    assert not e.known and not e.terminal
    for bad in [b"", b"[]", b"not json", b'{"order_id":"x","seq":"1","state":"processed","at":"2026-11-21T10:00:00Z"}',
                b'{"order_id":"x","seq":1,"state":"processed"}']:
        with pytest.raises(ValueError):
            StatusEvent.from_json(bad)


def test_seen_dedupes_on_order_and_seq_within_a_bound():
    seen = Seen(3)
    assert seen.first_time("a", 1) and seen.first_time("a", 2) and seen.first_time("b", 1)
    assert not seen.first_time("a", 1)
    assert seen.first_time(None, 0) and seen.first_time(None, 0)
    assert seen.first_time("c", 1)
    assert len(seen) == 3
    assert seen.first_time("a", 1), "the oldest is forgotten"
