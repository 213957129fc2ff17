"""Injectable clocks, so that leases, TTLs and timeouts are tested without sleeping."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds for durations and wall-clock milliseconds for what crosses machines."""

    def monotonic(self) -> float: ...

    def wall_ms(self) -> int: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000


class ManualClock:
    """A clock that moves only when a test says so."""

    def __init__(self, start: float = 1000.0, wall_start_ms: int = 1_700_000_000_000) -> None:
        self._now = start
        self._wall0 = wall_start_ms
        self._start = start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def wall_ms(self) -> int:
        with self._lock:
            return self._wall0 + int((self._now - self._start) * 1000)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


SYSTEM_CLOCK = SystemClock()


class Deadline:
    """An absolute point in monotonic time; ``remaining()`` never goes below zero."""

    __slots__ = ("at",)

    def __init__(self, timeout_s: float | None) -> None:
        self.at = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        if self.at is None:
            return None
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at
