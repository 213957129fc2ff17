"""Polling the framed connections for a moment before the master's event loop goes back to sleep.

An engine that makes one hot call after another (single-key exists, a lookup per request) sends its next
request soon after our answer. If the event loop has gone to sleep in epoll meanwhile, the kernel must
wake it, which on a VM costs a large part of a small call (figures: docs/decisions/0010, step 5). So
after answering, the loop polls every framed connection, without blocking, for up to ``spin_s``, and
returns to uvloop as soon as any has bytes (uvloop then finds them ready and does not sleep).

It is adaptive, as the clients' and stores' polling is: it polls only while requests have been coming
within the window of the answer before them, so a master whose callers pause (a put's data transfer, an
idle cluster) never burns CPU on it. Under load another request is almost always ready already, and the
poll returns at once. While it polls, nothing else runs on the loop, for at most ``spin_s``.
"""

from __future__ import annotations

import contextlib
import select

from kvpool.common.clock import SYSTEM_CLOCK, Clock


class IdlePoller:
    """One per framed server; ``spin_s`` 0 turns it off. ``clock`` is injected so tests need not sleep."""

    def __init__(self, spin_s: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self.spin_s = spin_s
        self._clock = clock
        self._epoll = select.epoll() if spin_s > 0 else None
        self.hot = True
        self._answered_at = 0.0

    def add(self, fd: int) -> None:
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN)

    def remove(self, fd: int) -> None:
        if self._epoll is not None:
            with contextlib.suppress(OSError, ValueError):  # already closed: epoll dropped it itself
                self._epoll.unregister(fd)

    def request_arrived(self) -> None:
        """A request came: poll after the next answer if it came within the window of the last one."""
        if self._epoll is not None:
            self.hot = self._clock.monotonic() - self._answered_at < self.spin_s

    def linger(self) -> None:
        """After an answer: poll the connections until one is readable, for at most ``spin_s``."""
        epoll = self._epoll
        if epoll is None:
            return
        now = self._clock.monotonic()
        self._answered_at = now
        if not self.hot:
            return
        until = now + self.spin_s
        while not epoll.poll(0):
            if self._clock.monotonic() >= until:
                return

    def close(self) -> None:
        epoll, self._epoll = self._epoll, None  # answers still given on open connections stop polling
        if epoll is not None:
            epoll.close()
