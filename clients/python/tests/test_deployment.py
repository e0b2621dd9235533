"""The client against a running deployment (see conftest.py)."""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timedelta, timezone

import pika
import pytest

from sas_saga_client import (
    Client,
    InvalidOrder,
    InvalidQueue,
    OrderFailed,
    Unroutable,
    WaitTimeout,
    uuid7,
)

WAIT = 60


def test_submit_then_wait_ends_processed_with_results(client, deployment):
    order_id = client.submit(deployment.workflow, {"sku": "A-1"})
    assert uuid.UUID(order_id).version == 7
    terminal = client.wait(order_id, WAIT)
    assert terminal.order_id == order_id
    assert terminal.state == "processed" and terminal.terminal
    assert "a" in terminal.detail["results"]

    other = client.submit(deployment.workflow, {"sku": "A-2"})
    results = client.result(other, WAIT)
    assert set(results) == {"a"}


def test_waits_of_several_orders_keep_each_others_terminal_events(client, deployment):
    ids = [client.submit(deployment.workflow, {"n": n}) for n in range(3)]
    # The last first: the others' terminal events are read meanwhile, and kept.
    for order_id in reversed(ids):
        assert client.wait(order_id, WAIT).state == "processed"


def test_the_same_order_id_twice_is_one_order(client, deployment):
    order_id = str(uuid7())
    assert client.submit(deployment.workflow, {"first": True}, order_id=order_id) == order_id
    assert client.submit(deployment.workflow, {"first": False}, order_id=uuid.UUID(order_id)) == order_id
    assert client.wait(order_id, WAIT).state == "processed"
    # A second order would publish events from seq 1 again: a fresh client
    # (which has seen nothing) finds none.
    with Client(deployment.url, deployment.prefix) as fresh:
        with fresh.events(client.status_queue, timeout=3) as stream:
            late = [e for e in stream if e.order_id == order_id]
    assert late == []


def test_an_order_of_an_unknown_workflow_is_rejected(client):
    order_id = client.submit("no-such-workflow", {})
    terminal = client.wait(order_id, WAIT)
    assert terminal.state == "rejected"
    assert terminal.seq == 0
    with pytest.raises(OrderFailed) as failed:
        client.result(client.submit("no-such-workflow", {}), WAIT)
    assert failed.value.event.state == "rejected"


def test_a_failing_order_raises_order_failed_with_its_terminal_event(client, deployment):
    order_id = client.submit(deployment.failing_workflow, {"sku": "B-1"})
    with pytest.raises(OrderFailed) as failed:
        client.result(order_id, WAIT)
    assert failed.value.event.order_id == order_id
    assert failed.value.event.state in ("compensated", "failed")


def test_only_the_terminal_event_when_asked(client, deployment):
    order_id = client.submit(deployment.workflow, {}, events="terminal", priority=9,
                             not_before=datetime.now(timezone.utc) - timedelta(seconds=1))
    with client.events(timeout=WAIT) as stream:
        first = next(e for e in stream if e.order_id == order_id)
    assert first.state == "processed"
    assert first.seq == 4, "the seq it has in the full history"


def test_events_dedupe_a_replayed_history(client, deployment):
    order_id = client.submit(deployment.workflow, {"sku": "C-1"})
    with client.events(timeout=WAIT) as stream:
        history = []
        for event in stream:
            assert event.order_id == order_id
            history.append((event.order_id, event.seq))
            if event.terminal:
                break
        assert [seq for _, seq in history] == list(range(1, len(history) + 1))
        assert history[-1][1] >= 4

        client.replay(order_id=order_id)  # to the order's own queue
        stream.timeout = 10
        surfaced = list(stream)
        assert surfaced == [], "replayed events are duplicates"
        assert stream.duplicates == len(history)


def test_replay_to_another_queue_gives_the_history(client, deployment, new_queue):
    order_id = client.submit(deployment.workflow, {})
    client.wait(order_id, WAIT)
    elsewhere = new_queue("replayed")
    client.declare_status_queue(elsewhere)
    client.replay(order_id=order_id, from_seq=2, to=elsewhere)
    got = []
    with client.events(elsewhere, timeout=10) as stream:
        for event in stream:
            got.append(event.seq)
            if event.terminal:
                break
    assert got == [2, 3, 4]
    with pytest.raises(InvalidQueue):
        client.replay(order_id=order_id, to=f"{deployment.prefix}.orders")
    with pytest.raises(ValueError):
        client.replay()


def test_an_unknown_state_is_kept_and_does_not_end_a_wait(client, deployment, raw):
    order_id = str(uuid7())
    fake = {
        "order_id": order_id,
        "seq": 100,
        "state": "step_paused",
        "step": "a",
        "attempt": 1,
        "at": "2026-11-21T10:00:00.123456Z",
        "detail": {"why": "a later version's state"},
    }
    props = pika.BasicProperties(content_type="application/json", delivery_mode=2)
    raw.basic_publish("", client.status_queue, json.dumps(fake).encode(), props)
    raw.basic_publish("", client.status_queue, b"not a status event", props)
    with pytest.warns(UserWarning, match="not a status event"):
        with client.events(timeout=10) as stream:
            event = next(stream)
            assert event.state == "step_paused"
            assert event.order_id == order_id and event.seq == 100 and event.step == "a"
            assert event.at == datetime(2026, 11, 21, 10, 0, 0, 123456, tzinfo=timezone.utc)
            assert not event.terminal and not event.known
            assert list(stream) == []
            assert stream.skipped == 1

    # The same fake event ahead of the order's own: the wait goes past it.
    with Client(deployment.url, deployment.prefix, status_queue=client.status_queue) as fresh:
        raw.basic_publish("", client.status_queue, json.dumps(fake).encode(), props)
        fresh.submit(deployment.workflow, {}, order_id=order_id)
        assert fresh.wait(order_id, WAIT).state == "processed"

    # Alone, it ends no wait.
    lone = str(uuid7())
    raw.basic_publish("", client.status_queue, json.dumps({**fake, "order_id": lone}).encode(), props)
    started = time.monotonic()
    with pytest.raises(WaitTimeout) as timed_out:
        client.wait(lone, 2)
    assert isinstance(timed_out.value, TimeoutError)
    assert time.monotonic() - started >= 1.9


def test_unroutable_when_the_prefix_has_no_orders_queue(deployment, raw):
    nobody = f"{deployment.prefix}-nobody"
    with Client(deployment.url, nobody) as lost:
        # Not even the exchange: no sas service of this prefix ever ran.
        with pytest.raises(Unroutable, match="no exchange"):
            lost.submit("one", {})
        # The exchange, and no queue bound to it.
        raw.exchange_declare(f"{nobody}.submit", exchange_type="fanout", auto_delete=False)
        try:
            with pytest.raises(Unroutable, match="no queue took"):
                lost.submit("one", {})
            with pytest.raises(Unroutable):
                lost.replay(order_id=uuid7())
        finally:
            raw.exchange_delete(f"{nobody}.submit")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"payload": ["not", "an", "object"]},
        {"payload": "text"},
        {"payload": None},
        {"payload": {"bad": "nul\x00"}},
        {"payload": {"n": 1e301}},
        {"payload": {"n": float("nan")}},
        {"payload": {"s": {1, 2}}},
        {"workflow": ""},
        {"workflow": "a\nb"},
        {"reply_to": "{prefix}.status"},
        {"reply_to": "{prefix}"},
        {"reply_to": "amq.gen-1"},
        {"reply_to": ""},
        {"priority": 10},
        {"priority": True},
        {"events": "some"},
        {"order_id": "not-a-uuid"},
        {"not_before": datetime(2026, 1, 1)},
        {"not_before": "tomorrow"},
    ],
)
def test_an_order_the_submission_would_reject_is_not_sent(client, deployment, kwargs):
    args = {"workflow": deployment.workflow, "payload": {}}
    args.update(kwargs)
    if isinstance(args.get("reply_to"), str):
        args["reply_to"] = args["reply_to"].format(prefix=deployment.prefix)
    workflow, payload = args.pop("workflow"), args.pop("payload")
    with pytest.raises(InvalidOrder):
        client.submit(workflow, payload, **args)


def test_a_payload_nested_too_deep_is_not_sent(client, deployment):
    deep: dict = {}
    for _ in range(64):
        deep = {"d": deep}
    with pytest.raises(InvalidOrder, match="64"):
        client.submit(deployment.workflow, deep)


def test_a_status_queue_of_sas_is_refused(deployment):
    for queue in (f"{deployment.prefix}.orders", "amq.x", ""):
        with pytest.raises(InvalidQueue):
            Client(deployment.url, deployment.prefix, status_queue=queue)
