"""The client: one connection to one sas deployment's RabbitMQ."""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
import warnings
from collections import OrderedDict, deque
from datetime import datetime
from typing import Any, Deque, Dict, Iterator, Optional, Tuple, Union

import pika
import pika.exceptions

from ._ids import uuid7
from .errors import (
    InvalidOrder,
    InvalidQueue,
    Nacked,
    NoStatusQueue,
    OrderFailed,
    PublishError,
    StreamEnded,
    Unroutable,
    WaitTimeout,
)
from .events import TERMINAL_STATES, Seen, StatusEvent, format_time, parse_time

log = logging.getLogger("sas_saga_client")

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2f"

#: Unacknowledged status events a stream holds at once.
STATUS_PREFETCH = 256
#: Events remembered per queue for deduplication.
REMEMBERED = 100_000
#: Terminal events kept for waits that have not come yet.
TERMINALS_KEPT = 10_000

MAX_NAME_BYTES = 255
MAX_JSON_DEPTH = 64
MAX_JSON_NUMBER = 1e300

OrderId = Union[str, uuid.UUID]


def is_queue_name(name: object) -> bool:
    """1 to 255 bytes, no control characters."""
    return (
        isinstance(name, str)
        and 0 < len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
        and not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name)
    )


def _order_id(value: OrderId) -> str:
    try:
        return str(value if isinstance(value, uuid.UUID) else uuid.UUID(str(value)))
    except (ValueError, TypeError, AttributeError):
        raise InvalidOrder(f"order_id is not a UUID: {value!r}") from None


def _check_payload(value: Any, depth: int = 0) -> None:
    """The limits of contract §1a on a payload's JSON."""
    if isinstance(value, (dict, list, tuple)):
        if depth >= MAX_JSON_DEPTH:
            raise InvalidOrder("payload: nested more than 64 levels deep")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and "\x00" in key:
                raise InvalidOrder("payload: a key holds a NUL character")
            _check_payload(item, depth + 1)
    elif isinstance(value, str):
        if "\x00" in value:
            raise InvalidOrder("payload: a string holds a NUL character")
    elif isinstance(value, bool) or value is None:
        pass
    elif isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise InvalidOrder("payload: an integer beyond 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value) or abs(value) > MAX_JSON_NUMBER:
            raise InvalidOrder("payload: a number beyond 1e300 in magnitude")


class Client:
    """A connection to one sas deployment's RabbitMQ (synchronous, pika's
    ``BlockingConnection``; use one client per thread).

    ``prefix`` is the deployment's ``broker.prefix``. ``status_queue``, when
    given, is declared (durable) and becomes the default ``reply_to`` of
    the orders submitted and the queue :meth:`wait` and :meth:`events`
    read.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        prefix: str = "sas",
        status_queue: Optional[str] = None,
        *,
        connection_name: str = "sas-client-python",
    ) -> None:
        if not prefix:
            raise ValueError("prefix must not be empty")
        self.prefix = prefix
        if status_queue is not None:
            self._usable_queue(status_queue, "the status queue")
        params = pika.URLParameters(url)
        params.client_properties = {"connection_name": connection_name}
        self._user: Optional[str] = getattr(params.credentials, "username", None)
        self._conn = pika.BlockingConnection(params)
        self._pub = self._publisher()
        self.status_queue: Optional[str] = None
        self._seen: Dict[str, Seen] = {}
        self._terminals: "OrderedDict[str, StatusEvent]" = OrderedDict()
        if status_queue is not None:
            self.declare_status_queue(status_queue)
            self.status_queue = status_queue

    # -- names ---------------------------------------------------------

    @property
    def orders_queue(self) -> str:
        return f"{self.prefix}.orders"

    @property
    def submit_exchange(self) -> str:
        return f"{self.prefix}.submit"

    @property
    def replay_queue(self) -> str:
        return f"{self.prefix}.replay"

    def is_reserved(self, queue: str) -> bool:
        """Whether ``queue`` is sas's (``<prefix>``, ``<prefix>.…``) or the
        broker's (``amq.…``): never an application's status queue (§1b)."""
        return (
            queue.startswith("amq.")
            or queue == self.prefix
            or queue.startswith(self.prefix + ".")
        )

    def _usable_queue(self, queue: object, what: str) -> str:
        if not is_queue_name(queue):
            raise InvalidQueue(f"{what} is not a queue name: {queue!r}")
        assert isinstance(queue, str)
        if self.is_reserved(queue):
            raise InvalidQueue(f"{what} {queue!r} is a queue of sas or of the broker")
        return queue

    # -- connection ----------------------------------------------------

    def _publisher(self) -> Any:
        ch = self._conn.channel()
        ch.confirm_delivery()
        return ch

    def close(self) -> None:
        """Closes the connection; events delivered and not acknowledged go
        back to their queues."""
        if self._conn.is_open:
            try:
                self._conn.close()
            except pika.exceptions.AMQPError:
                pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        return bool(self._conn.is_open)

    def declare_status_queue(self, queue: str) -> None:
        """Declares an application's status queue (durable), as it must
        exist before events are sent to it. A queue that exists with other
        arguments is used as it is."""
        self._usable_queue(queue, "the status queue")
        ch = self._conn.channel()
        try:
            ch.queue_declare(queue=queue, durable=True)
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code != 406:  # PRECONDITION_FAILED: exists otherwise
                raise
            return
        ch.close()

    # -- publishing ----------------------------------------------------

    def _publish(
        self, exchange: str, routing_key: str, body: bytes, props: pika.BasicProperties
    ) -> None:
        """Publishes with ``mandatory`` and waits for the confirm."""
        if self._pub.is_closed:
            self._pub = self._publisher()
        try:
            self._pub.basic_publish(
                exchange=exchange,
                routing_key=routing_key,
                body=body,
                properties=props,
                mandatory=True,
            )
        except pika.exceptions.UnroutableError:
            raise Unroutable(
                f"no queue took the message to {routing_key!r}: "
                f"no sas submission service of prefix {self.prefix!r} declared it"
            ) from None
        except pika.exceptions.NackError:
            raise Nacked(f"the broker refused the message to {routing_key!r}") from None
        except pika.exceptions.ChannelClosedByBroker as e:
            self._pub = self._publisher()
            if e.reply_code == 404:
                raise Unroutable(
                    f"no exchange {exchange!r}: no sas service of prefix "
                    f"{self.prefix!r} ever ran on this broker ({e.reply_text})"
                ) from None
            raise PublishError(f"the broker closed the channel: {e.reply_text}") from e

    def _props(self, message_id: Optional[str], reply_to: Optional[str]) -> pika.BasicProperties:
        return pika.BasicProperties(
            content_type="application/json",
            delivery_mode=2,
            message_id=message_id,
            reply_to=reply_to,
            # Who sends it, as RabbitMQ checks it: how sas tells
            # applications apart when identities are configured (§1b).
            user_id=self._user,
        )

    def submit(
        self,
        workflow: str,
        payload: Dict[str, Any],
        *,
        order_id: Optional[OrderId] = None,
        reply_to: Optional[str] = None,
        priority: Optional[int] = None,
        not_before: Optional[Union[datetime, str]] = None,
        events: Optional[str] = None,
    ) -> str:
        """Submits an order through ``<prefix>.submit`` with publisher
        confirms and ``mandatory``; returns its id (``order_id``, else a new
        UUIDv7), which is also the message id: submitting again with the
        same id after an unclear failure is the same order.

        The order goes to ``reply_to``, else the client's status queue.
        Raises :class:`InvalidOrder` for an order the submission would
        reject (unsent), :class:`Unroutable` when no submission service of
        the prefix declared the orders queue, :class:`Nacked` on a nack.
        """
        body = self._order_body(workflow, payload, order_id, reply_to, priority, not_before, events)
        oid = body["order_id"]
        data = json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
        log.debug("submitting order %s of workflow %s", oid, workflow)
        self._publish(
            self.submit_exchange,
            self.orders_queue,
            data,
            self._props(oid, body.get("reply_to")),
        )
        return oid

    def _order_body(
        self,
        workflow: Any,
        payload: Any,
        order_id: Optional[OrderId],
        reply_to: Optional[str],
        priority: Any,
        not_before: Any,
        events: Any,
    ) -> Dict[str, Any]:
        if not isinstance(workflow, str) or not is_queue_name(workflow):
            raise InvalidOrder(
                f"workflow must be a name of 1 to 255 bytes without control characters: {workflow!r}"
            )
        if not isinstance(payload, dict):
            raise InvalidOrder(f"payload must be a dict (a JSON object), not {type(payload).__name__}")
        _check_payload(payload)
        try:
            json.dumps(payload, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InvalidOrder(f"payload is not JSON: {e}") from None
        body: Dict[str, Any] = {
            "order_id": _order_id(order_id) if order_id is not None else str(uuid7()),
            "workflow": workflow,
            "payload": payload,
        }
        queue = reply_to if reply_to is not None else self.status_queue
        if queue is not None:
            try:
                body["reply_to"] = self._usable_queue(queue, "reply_to")
            except InvalidQueue as e:
                raise InvalidOrder(str(e)) from None
        if priority is not None:
            if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
                raise InvalidOrder(f"priority must be an integer 0 to 9: {priority!r}")
            body["priority"] = priority
        if not_before is not None:
            try:
                at = parse_time(not_before) if isinstance(not_before, str) else not_before
                if not isinstance(at, datetime):
                    raise ValueError(f"not a datetime: {not_before!r}")
                body["not_before"] = format_time(at)
            except (ValueError, OverflowError) as e:
                raise InvalidOrder(f"not_before: {e}") from None
        if events is not None:
            if events not in ("all", "terminal"):
                raise InvalidOrder(f'events must be "all" or "terminal": {events!r}')
            body["events"] = events
        return body

    # -- status events -------------------------------------------------

    def _seen_on(self, queue: str) -> Seen:
        seen = self._seen.get(queue)
        if seen is None:
            seen = self._seen[queue] = Seen(REMEMBERED)
        return seen

    def events(self, queue: Optional[str] = None, timeout: Optional[float] = None) -> "StatusStream":
        """The status events of ``queue`` (the client's status queue when
        None), declared first: an iterator of :class:`StatusEvent`,
        deduplicated on (order id, seq) with every event this client read
        from the queue before, each acknowledged once the next is asked for
        (or the stream is closed). It ends when no event comes for
        ``timeout`` seconds (None: it never ends). Use it as a context
        manager, or call :meth:`StatusStream.close`, so the last event is
        acknowledged. A message that is not a status event is acknowledged
        and skipped with a warning."""
        if queue is None:
            if self.status_queue is None:
                raise NoStatusQueue("events() needs a queue or the client's status_queue")
            queue = self.status_queue
        self.declare_status_queue(queue)
        return StatusStream(self, queue, timeout)

    def wait(self, order_id: OrderId, timeout: float) -> StatusEvent:
        """The terminal event of ``order_id`` (``processed``,
        ``compensated``, ``failed`` or ``rejected``) on the client's status
        queue, within ``timeout`` seconds; :class:`WaitTimeout` (a
        ``TimeoutError``) otherwise.

        It reads and acknowledges the queue: the events of other orders are
        consumed too, their terminal events kept for their own ``wait``.
        """
        if self.status_queue is None:
            raise NoStatusQueue("wait() needs the client's status_queue")
        oid = _order_id(order_id)
        kept = self._terminals.pop(oid, None)
        if kept is not None:
            return kept
        deadline = time.monotonic() + timeout
        stream = StatusStream(self, self.status_queue, None)
        try:
            while True:
                event = stream.next_before(deadline)
                if event is None:
                    raise WaitTimeout(oid, timeout)
                if not event.terminal:
                    continue
                if event.order_id == oid:
                    return event
                if isinstance(event.order_id, str):
                    self._keep_terminal(event)
        finally:
            # Acknowledges the last event read, the terminal one included.
            stream.close()

    def result(self, order_id: OrderId, timeout: float) -> Dict[str, Any]:
        """The results by step of a processed order (its ``processed``
        event's ``detail.results``); :class:`OrderFailed` with the terminal
        event when it ended otherwise, :class:`WaitTimeout` when it has
        not ended within ``timeout`` seconds."""
        event = self.wait(order_id, timeout)
        if event.state != "processed":
            raise OrderFailed(event)
        detail = event.detail if isinstance(event.detail, dict) else {}
        results = detail.get("results")
        return results if isinstance(results, dict) else {}

    def _keep_terminal(self, event: StatusEvent) -> None:
        key = event.order_id
        self._terminals.pop(key, None)
        self._terminals[key] = event
        while len(self._terminals) > TERMINALS_KEPT:
            self._terminals.popitem(last=False)

    # -- replay --------------------------------------------------------

    def replay(
        self,
        order_id: Optional[OrderId] = None,
        from_seq: int = 1,
        reply_to_queue: Optional[str] = None,
        since: Optional[Union[datetime, str]] = None,
        to: Optional[str] = None,
    ) -> None:
        """Asks sas to publish stored status events again (contract §9):
        one order's from ``from_seq`` on (``order_id``), or those at or
        after ``since`` of every order whose status queue is
        ``reply_to_queue``. They go to ``to``, else the order's own status
        queue or ``reply_to_queue``. Returns once the broker has the request
        (:class:`Unroutable` if no submission service declared
        ``<prefix>.replay``); the events follow, and :meth:`events` dedupes
        them with the ones it read."""
        body: Dict[str, Any]
        if order_id is not None:
            if reply_to_queue is not None or since is not None:
                raise ValueError("replay: order_id, or reply_to_queue and since, not both")
            if isinstance(from_seq, bool) or not isinstance(from_seq, int) or not 0 <= from_seq < 2**31:
                raise ValueError(f"replay: from_seq must be an integer 0 to 2^31-1: {from_seq!r}")
            body = {"order_id": _order_id(order_id), "from_seq": from_seq}
        elif reply_to_queue is not None and since is not None:
            if not is_queue_name(reply_to_queue):
                raise InvalidQueue(f"reply_to_queue is not a queue name: {reply_to_queue!r}")
            at = parse_time(since) if isinstance(since, str) else since
            body = {"reply_to": reply_to_queue, "since": format_time(at)}
        else:
            raise ValueError("replay: give order_id, or reply_to_queue and since")
        if to is not None:
            self._usable_queue(to, "to")
        data = json.dumps(body, separators=(",", ":")).encode()
        self._publish("", self.replay_queue, data, self._props(None, to))


class StatusStream:
    """The status events of one queue, from :meth:`Client.events`: an
    iterator of :class:`StatusEvent`, each acknowledged when the next is
    asked for or the stream is closed. Closing it without having read what
    the broker delivered hands that back to the queue."""

    def __init__(self, client: Client, queue: str, timeout: Optional[float]) -> None:
        self._client = client
        self.queue = queue
        #: How long (seconds) iterating waits for the next event before it ends; None: forever.
        self.timeout = timeout
        self._seen = client._seen_on(queue)
        self._buffer: Deque[Tuple[Any, Any, bytes]] = deque()
        self._unacked: Optional[int] = None
        #: Duplicates (an (order id, seq) seen before) dropped so far.
        self.duplicates = 0
        #: Messages that were not status events, skipped so far.
        self.skipped = 0
        self._cancelled = False
        self._closed = False
        self._ch = client._conn.channel()
        self._ch.basic_qos(prefetch_count=STATUS_PREFETCH)
        self._ch.add_on_cancel_callback(self._on_cancel)
        self._tag = self._ch.basic_consume(queue, self._on_message, auto_ack=False)

    def _on_message(self, _ch: Any, method: Any, props: Any, body: bytes) -> None:
        self._buffer.append((method, props, body))

    def _on_cancel(self, _frame: Any) -> None:
        self._cancelled = True

    def _ack_last(self) -> None:
        if self._unacked is not None:
            tag, self._unacked = self._unacked, None
            self._ch.basic_ack(tag)

    def _delivery_before(self, deadline: Optional[float]) -> Optional[Tuple[Any, Any, bytes]]:
        while not self._buffer:
            if self._cancelled or self._ch.is_closed:
                raise StreamEnded(f"the consumer of {self.queue} stopped: the channel or the queue is gone")
            if deadline is None:
                self._client._conn.process_data_events(time_limit=1)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._client._conn.process_data_events(time_limit=left)
        return self._buffer.popleft()

    def next_before(self, deadline: Optional[float]) -> Optional[StatusEvent]:
        """The next event not seen before, or None once ``deadline`` (a
        ``time.monotonic()`` value; None: no end) passes. Acknowledges the
        event returned last."""
        if self._closed:
            return None
        self._ack_last()
        while True:
            delivery = self._delivery_before(deadline)
            if delivery is None:
                return None
            method, _props, body = delivery
            try:
                event = StatusEvent.from_json(body)
            except ValueError as e:
                warnings.warn(
                    f"a message on {self.queue} is not a status event ({e}): acknowledged and skipped",
                    stacklevel=3,
                )
                self.skipped += 1
                self._ch.basic_ack(method.delivery_tag)
                continue
            if self._seen.first_time(event.order_id, event.seq):
                self._unacked = method.delivery_tag
                return event
            log.debug("duplicate status event dropped: %s seq %s", event.order_id, event.seq)
            self.duplicates += 1
            self._ch.basic_ack(method.delivery_tag)

    def __iter__(self) -> Iterator[StatusEvent]:
        return self

    def __next__(self) -> StatusEvent:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        event = self.next_before(deadline)
        if event is None:
            self.close()
            raise StopIteration
        return event

    def close(self) -> None:
        """Acknowledges the last event yielded and stops consuming; what was
        delivered and not yielded goes back to the queue."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._ch.is_open:
                self._ack_last()
                self._ch.close()
        except pika.exceptions.AMQPError:
            pass
        self._buffer.clear()

    def __enter__(self) -> "StatusStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Client", "StatusStream", "DEFAULT_URL", "TERMINAL_STATES", "is_queue_name"]
