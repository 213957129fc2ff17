"""Finding the master leader: the leader key's format, a watch on it, and the master-address parser.

This is the client/store side of leader election (the elector itself is ``kvpool.master.leader``); it lives
in ``common`` because clients and stores must not import ``kvpool.master``.

The key ``/kvpool/<cluster>/leader`` holds one of

* the leader's info, a JSON object such as ``{"grpc": "h:p", "rpc": "h:p", "metrics": "h:p", "id": "m1"}``,
  bound to the leader's lease. Its **view** is the revision of the write that made it leader (its
  mod_revision; for a key created by the create-if-absent campaign that equals its create_revision). Views
  only grow, so a store or client fences a deposed leader by refusing any view older than the newest seen.
* the vacancy marker ``{"__vacant__": <view of the leader that resigned>}``, without a lease, written by a
  leader that stepped down cleanly. A candidate takes it over with a compare-and-put and may serve at once,
  because the resigner had stopped serving before it wrote the marker (see ``kvpool.master.leader``).
* nothing: no leader, or the last one's lease expired.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvpool.common.coordinator import Coordinator, WatchHandle
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.etcd import EtcdClient, EventType, KeyValue, WatchEvent, cluster_prefix
from kvpool.common.etcd import parse_endpoints as _parse_endpoints
from kvpool.common.log import get_logger

__all__ = [
    "VACANT_FIELD",
    "LeaderInfo",
    "LeaderWatch",
    "leader_key",
    "parse_leader",
    "etcd_resolver",
    "parse_master_address",
    "vacancy_value",
]

log = get_logger(__name__)

VACANT_FIELD = "__vacant__"


def leader_key(cluster: str) -> str:
    return cluster_prefix(cluster) + "leader"


@dataclass(frozen=True)
class LeaderInfo:
    """The current leader as published in etcd: its self-description and its view (fencing token)."""

    info: dict[str, Any] = field(hash=False)
    view: int
    lease: int = 0

    def address(self, name: str) -> str | None:
        """One of the leader's advertised addresses (``"grpc"``, ``"rpc"``, ``"metrics"``), if present."""
        value = self.info.get(name)
        return value if isinstance(value, str) else None


def vacancy_value(resigned_view: int) -> bytes:
    return json.dumps({VACANT_FIELD: resigned_view}, separators=(",", ":")).encode()


def parse_leader(kv: KeyValue | None) -> LeaderInfo | None:
    """The leader a leader-key value describes; None for no key, the vacancy marker or a malformed value."""
    if kv is None:
        return None
    try:
        info = json.loads(kv.value)
    except ValueError:
        log.warning("leader key %s holds malformed JSON (%d bytes); ignoring it", kv.key, len(kv.value))
        return None
    if not isinstance(info, dict) or VACANT_FIELD in info:
        return None
    return LeaderInfo(info=info, view=kv.mod_revision, lease=kv.lease)


class LeaderWatch:
    """Tracks the leader key of one cluster through an etcd watch (which survives etcd member failures).

    The first read happens in the watch thread, so construction does not fail while etcd is unreachable;
    :meth:`get` returns None until a leader is known.
    """

    def __init__(self, etcd: Coordinator, cluster: str) -> None:
        self._key = leader_key(cluster)
        self._cond = threading.Condition()
        self._current: LeaderInfo | None = None
        self._newest_view = 0
        self._watcher: WatchHandle = etcd.watch(self._key, None, self._on_event)

    def _on_event(self, event: WatchEvent) -> None:
        leader = parse_leader(event.kv) if event.type is EventType.PUT else None
        with self._cond:
            if leader is not None and leader.view < self._newest_view:
                return  # never step back to an older leader
            self._current = leader
            if leader is not None:
                self._newest_view = leader.view
            self._cond.notify_all()

    def get(self) -> LeaderInfo | None:
        """The leader as last seen (None: none known now)."""
        with self._cond:
            return self._current

    def wait_for_change(self, known_view: int | None, timeout: float) -> LeaderInfo | None:
        """Wait until a leader with a view newer than ``known_view`` is published (None/0: any leader).

        Returns it, or None if none appeared within ``timeout`` seconds. Older views are ignored, so a
        caller that passes the view it is connected to only ever moves forward.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                leader = self._current
                if leader is not None and (not known_view or leader.view > known_view):
                    return leader
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def close(self) -> None:
        self._watcher.stop()

    def __enter__(self) -> LeaderWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_master_address(address: str) -> tuple[Literal["direct"], str] | tuple[Literal["etcd"], list[str]]:
    """Parse a master address as clients, stores and tools accept it (``KVPOOL_MASTER``).

    * ``"host:port"`` -> ``("direct", "host:port")``: talk to that master only (no HA).
    * ``"etcd://h1:p1,h2:p2"`` (``;`` separators too, as in Mooncake) -> ``("etcd", ["h1:p1", "h2:p2"])``:
      find the leader through etcd.
    """
    text = address.strip()
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme.lower() != "etcd":
            raise KvPoolError(
                ErrorCode.INVALID_ARGUMENT,
                f"unsupported master address scheme {scheme!r} in {address!r}: use host:port or etcd://h:p,...",
            )
        try:
            return "etcd", _parse_endpoints(rest)
        except KvPoolError as e:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"bad master address {address!r}: {e.message}") from None
    bad = KvPoolError(
        ErrorCode.INVALID_ARGUMENT, f"bad master address {address!r}: expected host:port or etcd://h:p,..."
    )
    if not text or "," in text or ";" in text or "/" in text:
        raise bad  # several masters without etcd would mean guessing the leader
    try:
        (endpoint,) = _parse_endpoints(text)
    except KvPoolError:
        raise bad from None
    return "direct", endpoint


# --- address resolution for clients and stores (one watch per endpoints+cluster per process) ---

_watches_lock = threading.Lock()
_watches: dict[tuple[str, str], LeaderWatch] = {}


def _watch_for(endpoints: list[str], cluster: str) -> LeaderWatch:
    key = (",".join(endpoints), cluster)
    with _watches_lock:
        watch = _watches.get(key)
        if watch is None:
            watch = LeaderWatch(EtcdClient(endpoints, timeout=2.0), cluster)
            _watches[key] = watch
        return watch


def etcd_resolver(master: str, cluster: str) -> Callable[[float], str]:
    """A function ``resolve(wait_s)`` returning the current leader's gRPC endpoint, waiting up to
    ``wait_s`` for one to be elected (callers pass what is left of their deadline)."""
    kind, endpoints = parse_master_address(master)
    if kind != "etcd":
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"not an etcd:// address: {master!r}")
    assert isinstance(endpoints, list)

    def resolve(wait_s: float = 5.0) -> str:
        watch = _watch_for(endpoints, cluster)
        leader = watch.get() or watch.wait_for_change(None, wait_s)
        address = leader.address("grpc") if leader else None
        if not address:
            raise KvPoolError(
                ErrorCode.UNAVAILABLE, f"no master leader in etcd {','.join(endpoints)} (cluster {cluster!r})"
            )
        return address

    return resolve
