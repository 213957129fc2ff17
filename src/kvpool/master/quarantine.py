"""Ranges of revoked puts, held until no WRITE grant for them can still be honoured by a store.

A client revokes a put when its transfer failed, typically on a timeout. Its WRITE bytes may still be on
their way: in the kernel send buffer of the connection the client gave up on (a graceful close still
sends them), in a slow network, or in the store's receive queue behind other requests. The store accepts
them as long as the put's WRITE grant has not expired (put start + put_timeout_s). If the master freed the
range at once, a later put could be given the same range and those late bytes would overwrite the new
object: every read of it fails its checksum (no wrong bytes are returned, but the object is lost, and the
store's inventory then names the revoked key for that range). The chaos partition test saw exactly this.

So a revoked put's key is forgotten at once (the writer may retry it), but its ranges stay allocated until
``put_time + put_timeout_s + RECLAIM_GRACE_S``, the same bound the reclaim of abandoned puts waits for;
the maintenance pass then frees them. Ranges of a segment that was unmounted meanwhile are dropped.
"""

from __future__ import annotations

import heapq
import itertools
import threading

from kvpool.master.segments import Segment

Range = tuple[Segment, int]


class RangeQuarantine:
    """A min-heap of (release time, ranges); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, list[Range], str]] = []  # (release at, tie-break, ranges, key)
        self._seq = itertools.count()

    def hold(self, release_at: float, ranges: list[Range], key: str = "") -> None:
        """Hold one object's ranges (``key``: the object, named in the stores' free notifications)."""
        if ranges:
            with self._lock:
                heapq.heappush(self._heap, (release_at, next(self._seq), ranges, key))

    def due(self, now: float) -> list[Range]:
        """Remove and return the ranges whose time has come (those of live segments only)."""
        return [r for _, ranges in self.due_by_key(now) for r in ranges]

    def due_by_key(self, now: float) -> list[tuple[str, list[Range]]]:
        """Like :meth:`due`, each object's ranges with its key."""
        out: list[tuple[str, list[Range]]] = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                _, _, ranges, key = heapq.heappop(self._heap)
                out.append((key, [r for r in ranges if not r[0].removed]))
        return out

    def held(self) -> list[Range]:
        """Every range still held (of live segments), for validate()."""
        with self._lock:
            ranges = [r for _, _, rs, _ in self._heap for r in rs]
        return [r for r in ranges if not r[0].removed]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(rs) for _, _, rs, _ in self._heap)
