"""The coordinator interface: what leader election, membership and durable intents need from etcd.

``EtcdClient`` (``kvpool.common.etcd``) is the real implementation. The master's HA code
(``master/leader.py``, ``master/ha.py``, ``master/intents.py``) is written against these protocols, so its
logic (election, fencing by views, step-down) can run on an in-memory fake in unit tests
(``tests/support/fake_coordinator.py``) as well as on a real etcd in the integration tests.

The contract is etcd's: every write returns a revision, revisions only grow, a compare fails when the key
moved, keys bound to a lease vanish when it ends, and a watch delivers every change in revision order.
Failures reach the caller as ``KvPoolError(ErrorCode.ETCD_ERROR, ...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvpool.common.etcd_types import KeyValue, WatchEvent

__all__ = ["Coordinator", "LeaseHandle", "WatchHandle"]


class WatchHandle(Protocol):
    """A running watch (``Watcher``): events arrive on its own thread until ``stop()``."""

    def stop(self) -> None: ...


class LeaseHandle(Protocol):
    """A lease kept alive in the background (``LeaseKeeper``); reports its loss once through ``on_lost``."""

    @property
    def lease_id(self) -> int: ...

    @property
    def ttl(self) -> float:
        """The granted TTL in seconds (etcd may raise a short one)."""
        ...

    @property
    def lost(self) -> bool: ...

    @property
    def expires_in(self) -> float:
        """Seconds until the local, conservative expiry estimate."""
        ...

    def start(self) -> int:
        """Grant the lease and start renewing it; returns the lease id."""
        ...

    def stop(self, revoke: bool = True, *, timeout: float | None = None) -> None: ...


class Coordinator(Protocol):
    """The narrow part of the etcd client that election, membership and intents use."""

    @property
    def timeout(self) -> float:
        """The default budget of one call, in seconds."""
        ...

    def read(
        self, key: str | bytes, *, prefix: bool = False, timeout: float | None = None
    ) -> tuple[list[KeyValue], int]: ...

    def get(self, key: str | bytes, *, timeout: float | None = None) -> KeyValue | None: ...

    def get_prefix(self, prefix: str | bytes, *, timeout: float | None = None) -> list[KeyValue]: ...

    def put(self, key: str | bytes, value: str | bytes, lease: int = 0, *, timeout: float | None = None) -> int: ...

    def delete(self, key: str | bytes, *, prefix: bool = False, timeout: float | None = None) -> bool: ...

    def create_if_absent(
        self, key: str | bytes, value: str | bytes, lease: int = 0, *, timeout: float | None = None
    ) -> tuple[bool, int, KeyValue | None]: ...

    def put_if_mod_revision(
        self,
        key: str | bytes,
        expected_mod_revision: int,
        value: str | bytes,
        lease: int = 0,
        *,
        timeout: float | None = None,
    ) -> tuple[bool, int, KeyValue | None]: ...

    def delete_if_mod_revision(
        self, key: str | bytes, expected_mod_revision: int, *, timeout: float | None = None
    ) -> bool: ...

    def watch(
        self,
        key_or_prefix: str | bytes,
        start_revision: int | None,
        callback: Callable[[WatchEvent], None],
        *,
        prefix: bool = False,
        on_resync: Callable[[list[KeyValue], int], None] | None = None,
    ) -> WatchHandle: ...

    def keep_lease(
        self, ttl_s: float, on_lost: Callable[[], None] | None = None, *, name: str = "lease"
    ) -> LeaseHandle:
        """A lease keeper, not yet started (``start()`` grants the lease)."""
        ...

    def close(self) -> None: ...
