"""IdlePoller: polls only while requests come back to back, and stops as soon as one is readable.

The poller reads an injected clock; these tests drive a clock that ticks once per reading, so the poll
window is counted in readings and no test sleeps or depends on the machine's speed.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvpool.common.clock import ManualClock
from kvpool.master.idle_poll import IdlePoller

TICK_S = 0.001


class TickingClock(ManualClock):
    """A manual clock that also moves ``TICK_S`` forward each time it is read, and counts the readings."""

    def __init__(self) -> None:
        super().__init__()
        self.readings = 0

    def monotonic(self) -> float:
        self.readings += 1
        self.advance(TICK_S)
        return super().monotonic()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def polled_for(poller: IdlePoller, clock: TickingClock) -> float:
    """The clock time one ``linger`` took."""
    started = clock.monotonic()
    poller.linger()
    return clock.monotonic() - started - TICK_S


def test_a_readable_connection_ends_the_poll_at_once(pair: tuple[socket.socket, socket.socket]) -> None:
    server_side, client_side = pair
    clock = TickingClock()
    poller = IdlePoller(spin_s=5.0, clock=clock)
    poller.add(server_side.fileno())
    client_side.send(b"next request")
    assert polled_for(poller, clock) < 5.0 / 2  # returned on readiness, not after the 5 s window
    poller.close()


def test_an_idle_connection_is_polled_for_the_window_then_not_after_a_slow_caller(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    server_side, _ = pair
    clock = TickingClock()
    poller = IdlePoller(spin_s=0.2, clock=clock)
    poller.add(server_side.fileno())
    assert polled_for(poller, clock) >= 0.2  # hot at first: polled the whole window
    clock.advance(0.3)  # the input: the next request comes later than the window after the answer
    poller.request_arrived()
    assert not poller.hot
    assert polled_for(poller, clock) < 0.2  # cold: back to the loop at once
    poller.request_arrived()  # this one came right after the answer
    assert poller.hot
    poller.close()


def test_removed_and_closed_connections_are_forgotten(pair: tuple[socket.socket, socket.socket]) -> None:
    server_side, client_side = pair
    clock = TickingClock()
    poller = IdlePoller(spin_s=0.2, clock=clock)
    fd = server_side.fileno()
    poller.add(fd)
    client_side.send(b"x")
    poller.remove(fd)
    assert polled_for(poller, clock) >= 0.2  # its bytes no longer end the poll
    poller.remove(fd)  # twice: no error
    poller.close()
    assert polled_for(poller, clock) < 0.2  # closed: answers given during shutdown do not poll


def test_zero_turns_it_off(pair: tuple[socket.socket, socket.socket]) -> None:
    server_side, _ = pair
    clock = TickingClock()
    poller = IdlePoller(spin_s=0.0, clock=clock)
    poller.add(server_side.fileno())
    poller.request_arrived()
    readings = clock.readings
    poller.linger()
    assert clock.readings == readings  # off: linger does not even read the clock
    assert poller.hot  # nothing is measured when off
    poller.close()


def test_the_default_clock_is_the_system_clock(pair: tuple[socket.socket, socket.socket]) -> None:
    server_side, client_side = pair
    poller = IdlePoller(spin_s=5.0)
    poller.add(server_side.fileno())
    client_side.send(b"ready")
    poller.linger()  # returns on readiness with the real clock too
    assert poller.hot
    poller.close()
