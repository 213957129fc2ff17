"""Object checksums: xxh3-64 of the whole value (fast enough to verify on every read).

xxhash releases the GIL while it hashes a buffer of more than 64 KiB (python-xxhash's threshold; a
smaller one takes a few microseconds), so a large checksum computed on a transport's lane thread runs in
parallel with the other lanes' socket copies; computed right before the bytes are sent (or right after
they land) it also reads them from cache instead of memory.
"""

from __future__ import annotations

import threading

import xxhash


def checksum(data: bytes | bytearray | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


def checksum_parts(parts: list[memoryview]) -> int:
    """The checksum of the concatenation of ``parts`` (scatter-gather values)."""
    if len(parts) == 1:
        return checksum(parts[0])
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return int(hasher.intdigest())


class LazyChecksum:
    """The checksum of a buffer, computed once by whichever thread asks first.

    A writer hands one to the transport instead of an int: the lane that sends the object computes it
    just before the send (the bytes are then hot for the socket copy, and other lanes keep moving), and
    the writer reads the same value afterwards for PutEnd. Thread-safe.
    """

    __slots__ = ("_data", "_value", "_lock")

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._value: int | None = None
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        value = self._value
        if value is None:
            with self._lock:
                if self._value is None:
                    self._value = checksum(self._data)
                value = self._value
        return value

    def settle(self, value: int) -> None:
        """Take a value computed elsewhere, before anyone asked: the checksum of GPU memory, which the CPU
        cannot read through the buffer (client/device_buffers.py)."""
        with self._lock:
            self._value = value


def checksum_value(value: int | LazyChecksum) -> int:
    return value if isinstance(value, int) else value.value
