"""The replica descriptors of objects this client holds a live read lease on.

A read lease is the master's promise that, until it ends, the object is not evicted, not removed
(unless forced) and not moved off its segment (a drain frees the source only after the leases granted
before the move have ended). So while the lease holds, the descriptors and the grant that came with it
are as good as fresh ones: a client that reads the same object again - the hot prefix of a system
prompt, re-read by every request that shares it - can skip the master and make the read one data round
trip. An entry is used only until ``margin_ms`` before its lease (or grant) ends, so that the read
completes under the lease; the read still checks the checksum and the lease expiry as any other.

What this gives up, and why it is safe: reads served here do not refresh the master's last-access time
(the lease grant did, at most one lease ago) - which is also why objects held only on an SSD tier are
never cached: the master counts their reads to promote them - and an object another client *force*-removes may still be
read from a live entry until the lease ends - the same race a read that fetched its descriptors just
before the removal has, stretched to one lease. A cached read that fails in any way (the range was
reused: checksum mismatch; the store restarted: segment not found) drops the entry and asks the master.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvpool.common.clock import Clock


class LeaseCache:
    """A bounded, thread-safe map key -> resolved master answer (code, size, checksum, lease expiry,
    replicas), least recently used out first."""

    def __init__(self, max_entries: int, clock: Clock, margin_ms: int = 1000) -> None:
        self._max = max_entries
        self._clock = clock
        self._margin_ms = margin_ms
        self._entries: OrderedDict[str, tuple[int, Any]] = OrderedDict()  # key -> (usable until, result)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._max > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Any | None:
        """The cached result, if its lease still has ``margin_ms`` to run."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry[0] <= self._clock.wall_ms():
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: str, result: Any) -> None:
        """Remember a readable result (code OK, with replicas) of a leased lookup. An object with no DRAM
        replica is not kept: the master counts its reads to decide when to promote it from SSD."""
        if not self._max or not any(d.tier == 0 for d in result.replicas):
            return
        until = min(result.lease_expiry_ms, min(d.expiry_ms for d in result.replicas)) - self._margin_ms
        if until <= self._clock.wall_ms():
            return
        with self._lock:
            self._entries[key] = (until, result)
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def drop(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
