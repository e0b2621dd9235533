"""Status events (contract §2) as Python objects."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Optional, Tuple

#: The states that end an order: exactly one of these per order (again after
#: an operator's retry or redrive).
TERMINAL_STATES = frozenset({"processed", "compensated", "failed", "rejected"})

#: The states this version knows; an event of any other state (a later
#: version's) is kept, with its state as it came.
KNOWN_STATES = frozenset(
    {
        "received",
        "rejected",
        "processing",
        "step_succeeded",
        "step_skipped",
        "retry_scheduled",
        "deadline_warning",
        "heartbeat",
        "held",
        "resumed",
        "compensating",
        "processed",
        "compensated",
        "failed",
        "redriven",
    }
)

_RFC3339 = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))$"
)


def parse_time(text: str) -> datetime:
    """An RFC 3339 time (``2026-11-21T10:00:00.123456Z``) as an aware
    datetime in UTC; digits beyond microseconds are dropped."""
    m = _RFC3339.match(text)
    if not m:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    year, month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 7))
    micro = int((m.group(7) or "0")[:6].ljust(6, "0"))
    if m.group(8):
        tz = timezone.utc
    else:
        offset = timedelta(hours=int(m.group(10)), minutes=int(m.group(11)))
        tz = timezone(-offset if m.group(9) == "-" else offset)
    if second == 60:  # a leap second: the moment after
        second = 59
        micro = 999_999
    return datetime(year, month, day, hour, minute, second, micro, tzinfo=tz).astimezone(
        timezone.utc
    )


def format_time(at: datetime) -> str:
    """An aware datetime as RFC 3339 in UTC (``…Z``); a naive one is refused."""
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError("a time must be timezone-aware (e.g. datetime.now(timezone.utc))")
    return at.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class StatusEvent:
    """One status event (contract §2).

    ``order_id`` is the order's id as a string; in a ``rejected`` event it
    is the id as the refused message gave it (whatever its type), or None.
    ``state`` is a string: a known state (:data:`KNOWN_STATES`) or a later
    version's, kept as it came.
    """

    order_id: Any
    seq: int
    state: str
    step: Optional[str]
    attempt: Optional[int]
    at: datetime
    detail: Any

    @property
    def terminal(self) -> bool:
        """Whether the event ends its order."""
        return self.state in TERMINAL_STATES

    @property
    def known(self) -> bool:
        """Whether this version knows the state."""
        return self.state in KNOWN_STATES

    @classmethod
    def from_json(cls, body: bytes) -> "StatusEvent":
        """Reads a status event; ``ValueError`` if the body is not one."""
        try:
            doc = json.loads(body)
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        for field in ("order_id", "seq", "state", "at"):
            if field not in doc:
                raise ValueError(f"missing field `{field}`")
        seq, state, at = doc["seq"], doc["state"], doc["at"]
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise ValueError("`seq` is not an integer")
        if not isinstance(state, str):
            raise ValueError("`state` is not a string")
        if not isinstance(at, str):
            raise ValueError("`at` is not a string")
        step = doc.get("step")
        if step is not None and not isinstance(step, str):
            raise ValueError("`step` is not a string")
        attempt = doc.get("attempt")
        if attempt is not None and (isinstance(attempt, bool) or not isinstance(attempt, int)):
            raise ValueError("`attempt` is not an integer")
        return cls(
            order_id=doc["order_id"],
            seq=seq,
            state=state,
            step=step,
            attempt=attempt,
            at=parse_time(at),
            detail=doc.get("detail"),
        )


class Seen:
    """The keys (order id, seq) of the last ``capacity`` events: an event
    whose key is among them is a duplicate. Memory stays bounded; a
    duplicate older than that comes through again (redeliveries come soon
    after the original). An event without an order id has no identity: it
    is never a duplicate."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._keys: "OrderedDict[Tuple[str, int], None]" = OrderedDict()
        self._capacity = max(1, capacity)

    def first_time(self, order_id: Any, seq: int) -> bool:
        if order_id is None:
            return True
        key_id = order_id if isinstance(order_id, str) else json.dumps(order_id)
        key = (key_id, seq)
        if key in self._keys:
            return False
        self._keys[key] = None
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._keys)
