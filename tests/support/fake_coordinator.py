"""FakeCoordinator: an in-memory stand-in for etcd behind the ``Coordinator`` protocol, for unit tests.

It is a fake, not etcd: one process, no network, no raft. It keeps etcd's contract as the HA code relies on
it (``kvpool.common.coordinator``): one growing revision for every write, compares on create/mod
revisions, keys bound to a lease deleted with it, watches that see every change in revision order (with
list-then-watch when started without a revision). Leases never expire on their own: a test ends one with
:meth:`FakeCoordinator.expire_lease`, as etcd would after the holder went silent, and cuts the "cluster"
off with :meth:`FakeCoordinator.partition` (every call then fails with ETCD_ERROR, as an unreachable etcd
does after its deadline). Watch callbacks run on the thread that made the change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.etcd import EventType, KeyValue, WatchEvent

__all__ = ["FakeCoordinator", "FakeLease", "FakeWatch"]


def _text(key: str | bytes) -> str:
    return key.decode("utf-8", "surrogateescape") if isinstance(key, bytes) else key


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


@dataclass
class FakeWatch:
    """A watch on the fake; ``stop()`` ends deliveries."""

    key: str
    prefix: bool
    callback: Callable[[WatchEvent], None]
    stopped: bool = False

    def matches(self, key: str) -> bool:
        return key.startswith(self.key) if self.prefix else key == self.key

    def stop(self) -> None:
        self.stopped = True


@dataclass
class FakeLease:
    """A lease on the fake. ``start()`` grants it (the TTL exactly as asked: no whole-second rounding)."""

    coordinator: FakeCoordinator
    requested_ttl: float
    on_lost: Callable[[], None] | None
    name: str
    lease_id: int = 0
    ttl: float = 0.0
    _lost: threading.Event = field(default_factory=threading.Event)
    stopped: bool = False

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def expires_in(self) -> float:
        """A live lease is renewed in the background, so a whole TTL is always left until it is lost."""
        return 0.0 if self.lost else self.ttl

    def start(self) -> int:
        self.lease_id = self.coordinator._grant(self)
        self.ttl = self.requested_ttl
        return self.lease_id

    def stop(self, revoke: bool = True, *, timeout: float | None = None) -> None:
        self.stopped = True
        if revoke and self.lease_id and not self.lost:
            try:
                self.coordinator._end_lease(self.lease_id, report=False)
            except KvPoolError:
                pass  # unreachable: like etcd, the lease then lives on until it expires

    def _lose(self) -> None:
        if self.stopped or self.lost:
            return
        self._lost.set()
        if self.on_lost is not None:
            self.on_lost()


class FakeCoordinator:
    """In-memory ``Coordinator``; see the module docstring for what it keeps of etcd and what it does not."""

    def __init__(self, timeout: float = 2.0) -> None:
        self.timeout = timeout
        self._lock = threading.RLock()
        self._kvs: dict[str, KeyValue] = {}
        self._revision = 1
        self._leases: dict[int, FakeLease] = {}
        self._next_lease = 0x1000
        self._watches: list[FakeWatch] = []
        self._partitioned = False
        self.closed = False

    # ---- the test's controls ---------------------------------------------------------------------------

    def partition(self, cut: bool = True) -> None:
        """Make every call fail (``cut``) or work again; leases keep their state meanwhile."""
        self._partitioned = cut

    def expire_lease(self, lease_id: int) -> None:
        """End a lease as etcd does when its holder stopped renewing: its keys go, its holder hears of it."""
        with self._lock:
            self._end_lease(lease_id, report=True, check=False)

    def leases(self) -> list[int]:
        with self._lock:
            return list(self._leases)

    @property
    def revision(self) -> int:
        return self._revision

    # ---- Coordinator ------------------------------------------------------------------------------------

    def read(
        self, key: str | bytes, *, prefix: bool = False, timeout: float | None = None
    ) -> tuple[list[KeyValue], int]:
        self._check("read")
        k = _text(key)
        with self._lock:
            kvs = [kv for name, kv in sorted(self._kvs.items()) if (name.startswith(k) if prefix else name == k)]
            return kvs, self._revision

    def get(self, key: str | bytes, *, timeout: float | None = None) -> KeyValue | None:
        kvs, _ = self.read(key)
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: str | bytes, *, timeout: float | None = None) -> list[KeyValue]:
        kvs, _ = self.read(prefix, prefix=True)
        return kvs

    def put(self, key: str | bytes, value: str | bytes, lease: int = 0, *, timeout: float | None = None) -> int:
        self._check("put")
        with self._lock:
            return self._put(_text(key), _bytes(value), lease)

    def delete(self, key: str | bytes, *, prefix: bool = False, timeout: float | None = None) -> bool:
        self._check("delete")
        k = _text(key)
        with self._lock:
            names = [name for name in self._kvs if (name.startswith(k) if prefix else name == k)]
            if names:
                self._revision += 1
            for name in names:
                self._delete(name)
            return bool(names)

    def create_if_absent(
        self, key: str | bytes, value: str | bytes, lease: int = 0, *, timeout: float | None = None
    ) -> tuple[bool, int, KeyValue | None]:
        return self.put_if_mod_revision(key, 0, value, lease)

    def put_if_mod_revision(
        self,
        key: str | bytes,
        expected_mod_revision: int,
        value: str | bytes,
        lease: int = 0,
        *,
        timeout: float | None = None,
    ) -> tuple[bool, int, KeyValue | None]:
        self._check("compare_and_put")
        k = _text(key)
        with self._lock:
            current = self._kvs.get(k)
            if (current.mod_revision if current is not None else 0) != expected_mod_revision:
                return False, self._revision, current
            return True, self._put(k, _bytes(value), lease), None

    def delete_if_mod_revision(
        self, key: str | bytes, expected_mod_revision: int, *, timeout: float | None = None
    ) -> bool:
        self._check("delete_if")
        k = _text(key)
        with self._lock:
            current = self._kvs.get(k)
            if current is None or current.mod_revision != expected_mod_revision:
                return False
            self._revision += 1
            self._delete(k)
            return True

    def watch(
        self,
        key_or_prefix: str | bytes,
        start_revision: int | None,
        callback: Callable[[WatchEvent], None],
        *,
        prefix: bool = False,
        on_resync: Callable[[list[KeyValue], int], None] | None = None,
    ) -> FakeWatch:
        """Only list-then-watch (``start_revision`` None or <= 0): the fake keeps no event history."""
        if start_revision is not None and start_revision > 0:
            raise NotImplementedError("FakeCoordinator keeps no history: watch from the current state")
        watch = FakeWatch(_text(key_or_prefix), prefix, callback)
        with self._lock:
            kvs = [kv for name, kv in sorted(self._kvs.items()) if watch.matches(name)]
            if on_resync is not None:
                on_resync(kvs, self._revision)
            else:
                for kv in kvs:
                    callback(WatchEvent(EventType.PUT, kv, synthetic=True))
                if not prefix and not kvs:
                    callback(WatchEvent(EventType.DELETE, KeyValue(watch.key, b"", 0, self._revision, 0, 0), True))
            self._watches.append(watch)
        return watch

    def keep_lease(self, ttl_s: float, on_lost: Callable[[], None] | None = None, *, name: str = "lease") -> FakeLease:
        return FakeLease(self, ttl_s, on_lost, name)

    def close(self) -> None:
        self.closed = True
        with self._lock:
            for watch in self._watches:
                watch.stop()

    # ---- inside -----------------------------------------------------------------------------------------

    def _check(self, what: str) -> None:
        if self.closed:
            raise KvPoolError(ErrorCode.ETCD_ERROR, f"etcd {what}: client is closed")
        if self._partitioned:
            raise KvPoolError(
                ErrorCode.ETCD_ERROR, f"etcd {what}: no answer within {self.timeout:.2f}s (fake partition)"
            )

    def _grant(self, lease: FakeLease) -> int:
        self._check("lease_grant")
        with self._lock:
            self._next_lease += 1
            self._leases[self._next_lease] = lease
            return self._next_lease

    def _end_lease(self, lease_id: int, *, report: bool, check: bool = True) -> None:
        if check:
            self._check("lease_revoke")
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            bound = [name for name, kv in self._kvs.items() if kv.lease == lease_id]
            if bound:
                self._revision += 1
            for name in bound:
                self._delete(name)
        if report and lease is not None:
            lease._lose()

    def _put(self, key: str, value: bytes, lease: int) -> int:
        if lease and lease not in self._leases:
            raise KvPoolError(ErrorCode.ETCD_ERROR, f"etcd put: lease {lease:x} not found")
        self._revision += 1
        old = self._kvs.get(key)
        kv = KeyValue(
            key=key,
            value=value,
            create_revision=old.create_revision if old is not None else self._revision,
            mod_revision=self._revision,
            version=(old.version if old is not None else 0) + 1,
            lease=lease,
        )
        self._kvs[key] = kv
        self._notify(WatchEvent(EventType.PUT, kv))
        return self._revision

    def _delete(self, key: str) -> None:
        """Delete at the current revision (the caller bumped it once for the whole delete)."""
        del self._kvs[key]
        self._notify(WatchEvent(EventType.DELETE, KeyValue(key, b"", 0, self._revision, 0, 0)))

    def _notify(self, event: WatchEvent) -> None:
        for watch in list(self._watches):
            if not watch.stopped and watch.matches(event.kv.key):
                watch.callback(event)
