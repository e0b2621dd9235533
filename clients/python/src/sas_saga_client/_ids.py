"""Order ids: UUIDv7 (RFC 9562), which Python's :mod:`uuid` lacks before 3.14.

A UUIDv7 starts with the Unix time in milliseconds, so ids made one after
another sort in time order (as the Rust client's ``Uuid::now_v7`` do).
"""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_counter = 0


def uuid7() -> uuid.UUID:
    """A new UUIDv7: 48 bits of milliseconds, then 74 random bits.

    Within one millisecond the 12 bits after the version carry a counter
    seeded at random, so the ids of one process keep increasing.
    """
    global _last_ms, _counter
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms > _last_ms:
            _last_ms = ms
            _counter = int.from_bytes(os.urandom(2), "big") & 0x7FF
        else:
            # The same millisecond (or the clock went back): count on.
            _counter += 1
            if _counter > 0xFFF:
                _last_ms += 1
                _counter = 0
            ms = _last_ms
        counter = _counter
    rand_b = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version 7
    value |= counter << 64
    value |= 0b10 << 62  # RFC 4122 variant
    value |= rand_b
    return uuid.UUID(int=value)
