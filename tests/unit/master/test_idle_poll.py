"""IdlePoller: polls only while requests come back to back, and stops as soon as one is readable."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from kvpool.master.idle_poll import IdlePoller


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def timed_linger(poller: IdlePoller) -> float:
    started = time.perf_counter()
    poller.linger()
    return time.perf_counter() - started


def test_a_readable_connection_ends_the_poll_at_once(pair: tuple[socket.socket, socket.socket]) -> None:
    server_side, client_side = pair
    poller = IdlePoller(spin_s=5.0)
    poller.add(server_side.fileno())
    client_side.send(b"next request")
    assert timed_linger(poller) < 2.5  # returned on readiness, not after the 5 s window
    poller.close()


def test_an_idle_connection_is_polled_for_the_window_then_not_after_a_slow_caller(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    server_side, _ = pair
    poller = IdlePoller(spin_s=0.2)
    poller.add(server_side.fileno())
    assert timed_linger(poller) >= 0.2  # hot at first: polled the whole window
    time.sleep(0.3)  # the input: the next request comes later than the window after the answer
    poller.request_arrived()
    assert not poller.hot
    assert timed_linger(poller) < 0.2  # cold: back to the loop at once
    poller.request_arrived()  # this one came right after the answer
    assert poller.hot
    poller.close()


def test_removed_and_closed_connections_are_forgotten(pair: tuple[socket.socket, socket.socket]) -> None:
    server_side, client_side = pair
    poller = IdlePoller(spin_s=0.2)
    fd = server_side.fileno()
    poller.add(fd)
    client_side.send(b"x")
    poller.remove(fd)
    assert timed_linger(poller) >= 0.2  # its bytes no longer end the poll
    poller.remove(fd)  # twice: no error
    poller.close()
    assert timed_linger(poller) < 0.2  # closed: answers given during shutdown do not poll


def test_zero_turns_it_off(pair: tuple[socket.socket, socket.socket]) -> None:
    server_side, _ = pair
    poller = IdlePoller(spin_s=0.0)
    poller.add(server_side.fileno())
    poller.request_arrived()
    assert timed_linger(poller) < 0.5
    assert poller.hot  # nothing is measured when off
    poller.close()
