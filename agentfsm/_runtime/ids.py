"""UUIDv7 loop ids: unique, and sortable by creation time within a process."""

from __future__ import annotations

import random
import time

_last_ms = 0
_counter = 0


def uuid7() -> str:
    """A UUIDv7 string (RFC 9562): 48-bit milliseconds, a 12-bit counter, 62 random bits.

    The counter orders ids made in the same millisecond; when it would overflow,
    the timestamp is advanced by one millisecond, so ids keep increasing.
    """
    global _last_ms, _counter
    ms = time.time_ns() // 1_000_000
    if ms > _last_ms:
        _last_ms, _counter = ms, 0
    else:
        _counter += 1
        if _counter > 0xFFF:
            _last_ms, _counter = _last_ms + 1, 0
    # Uniqueness, not secrecy: the module's generator is reseeded after a fork.
    rand = random.getrandbits(62)
    value = (_last_ms << 80) | (0x7 << 76) | (_counter << 64) | (0b10 << 62) | rand
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
