"""Per-client data-plane limits (kvpool.store.limits): the bookkeeping, without sockets."""

from __future__ import annotations

import pytest

from kvpool.store.limits import ClientLimits, client_of


def test_connections_per_client() -> None:
    limits = ClientLimits(max_connections=2)
    assert limits.open("a")
    assert limits.open("a")
    assert not limits.open("a")  # a third from the same client
    assert limits.open("b")  # others are not affected
    limits.close("a")
    assert limits.open("a")
    assert limits.refused_connections == 1
    for _ in range(2):
        limits.close("a")
    assert limits.connections("a") == 0


def test_bytes_in_flight_per_client() -> None:
    limits = ClientLimits(max_inflight_bytes=100)
    assert limits.reserve("a", 60)
    assert not limits.reserve("a", 41)
    assert limits.reserve("a", 40)
    assert limits.inflight("a") == 100
    assert limits.reserve("b", 100)
    limits.release("a", 60)
    assert limits.reserve("a", 60)
    assert not limits.reserve("c", 101)  # one part over the budget can never be served
    assert limits.refused_requests == 2


def test_zero_means_no_limit() -> None:
    limits = ClientLimits()
    assert all(limits.open("a") for _ in range(10_000))
    assert limits.reserve("a", 1 << 62)
    assert not limits.bytes_limited
    with pytest.raises(ValueError, match=">= 0"):
        ClientLimits(max_connections=-1)


@pytest.mark.parametrize(("peer", "client"), [("10.0.0.1:5000", "10.0.0.1"), ("::1:5000", "::1"), ("x", "x")])
def test_client_of(peer: str, client: str) -> None:
    assert client_of(peer) == client
