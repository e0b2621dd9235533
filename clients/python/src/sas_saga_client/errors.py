"""What can go wrong, as exceptions: all are :class:`SasError`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .events import StatusEvent


class SasError(Exception):
    """Any error of this package."""


class InvalidOrder(SasError, ValueError):
    """The order would be rejected by the submission (contract §1): not sent."""


class InvalidQueue(SasError, ValueError):
    """Not a usable queue name: 1 to 255 bytes, no control characters, and
    not one of sas's (``<prefix>``, ``<prefix>.…``) or the broker's
    (``amq.…``)."""


class PublishError(SasError):
    """The broker did not take a message."""


class Unroutable(PublishError):
    """The broker returned the message: no queue took it. For an order, no
    submission service of this prefix ever declared ``<prefix>.orders`` (or
    the exchange ``<prefix>.submit`` does not exist); for a replay request,
    ``<prefix>.replay``."""


class Nacked(PublishError):
    """The broker refused the message (a negative publisher confirm)."""


class NoStatusQueue(SasError):
    """The operation needs the client's status queue: give ``status_queue``
    to :class:`~sas_saga_client.Client`."""


class StreamEnded(SasError):
    """The consumer of a status queue stopped: its channel closed or the
    queue was deleted."""


class WaitTimeout(SasError, TimeoutError):
    """No terminal event for the order within the time given."""

    def __init__(self, order_id: str, waited: float) -> None:
        super().__init__(f"no terminal event for order {order_id} within {waited}s")
        self.order_id = order_id
        self.waited = waited


class OrderFailed(SasError):
    """The order ended without being processed: its terminal event
    (``compensated``, ``failed`` or ``rejected``) is :attr:`event`."""

    def __init__(self, event: "StatusEvent") -> None:
        why: Optional[object] = None
        if isinstance(event.detail, dict):
            why = event.detail.get("error") or event.detail.get("reason")
        text = f"order {event.order_id} ended {event.state}"
        if why:
            text += f": {why}"
        super().__init__(text)
        self.event = event
