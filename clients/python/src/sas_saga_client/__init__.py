"""sas-saga-client: a Python application's side of sas (Scheduler Agent Supervisor).

The same operations as the Rust client (``client/``), over RabbitMQ with
pika, as the contract asks (docs/contract.md §1, §2, §9):

- :meth:`Client.submit`: an order through ``<prefix>.submit`` with publisher
  confirms and ``mandatory``, its id a UUIDv7 unless given;
- :meth:`Client.events`: a status queue's events, deduplicated on
  (order id, seq), each acknowledged once the next is asked for;
- :meth:`Client.wait` / :meth:`Client.result`: an order's terminal event, or
  its results;
- :meth:`Client.replay`: stored status events published again.

::

    from sas_saga_client import Client

    with Client("amqp://guest:guest@127.0.0.1:55673/%2f", "sas", status_queue="shop.status") as sas:
        order_id = sas.submit("order", {"sku": "A-1"})
        print(sas.wait(order_id, timeout=60).state)
"""

from ._ids import uuid7
from .client import DEFAULT_URL, Client, StatusStream, is_queue_name
from .errors import (
    InvalidOrder,
    InvalidQueue,
    Nacked,
    NoStatusQueue,
    OrderFailed,
    PublishError,
    SasError,
    StreamEnded,
    Unroutable,
    WaitTimeout,
)
from .events import KNOWN_STATES, TERMINAL_STATES, StatusEvent

__version__ = "0.1.0"

__all__ = [
    "Client",
    "DEFAULT_URL",
    "InvalidOrder",
    "InvalidQueue",
    "KNOWN_STATES",
    "Nacked",
    "NoStatusQueue",
    "OrderFailed",
    "PublishError",
    "SasError",
    "StatusEvent",
    "StatusStream",
    "StreamEnded",
    "TERMINAL_STATES",
    "Unroutable",
    "WaitTimeout",
    "is_queue_name",
    "uuid7",
]
