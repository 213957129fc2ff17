"""The segment table: mounted segments, the stores that own them, and the stores' free-notification queues.

A *segment* is one contiguous memory region a store contributes; the master keeps its info, its grant
secret, its offset allocator and its status. A *store* (one process, possibly several segments) is alive
while it heartbeats.

Free notifications: every time the master frees a range (evict, remove, revoke, reclaim) it queues
``(segment_id, offset, seq)`` for the owning store; heartbeats deliver them and the store drops those ranges
from its inventory (the inventory is what a new leader rebuilds the index from after a failover). The queue
is bounded; see ``StoreEntry``.

Mutations of the table happen under the master's membership lock (see shards.py for the lock order). The hot
paths read ``by_id`` and ``allocatable`` without a lock: a dict lookup and a tuple reference are atomic in
CPython, and both are replaced/updated only by the (serialised) membership operations.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from itertools import islice

from kvpool.common import grants
from kvpool.master.allocator import OffsetAllocator

__all__ = [
    "FREE_QUEUE_LIMIT",
    "Segment",
    "SegmentInfo",
    "SegmentStatus",
    "SegmentTable",
    "StoreEntry",
]

FREE_QUEUE_LIMIT = 1_000_000
"""Pending free notifications kept per store. If a store stops acknowledging (or the master frees faster than
heartbeats drain), the oldest notifications are dropped. Worst case: the store keeps a freed object in its
inventory and, after a failover, the new leader re-adopts it, so a removed object reappears. That is harmless
for a cache: its bytes and checksum are still those of that key (values are immutable), unless the range was
reused meanwhile; then the new owner's inventory entry overlaps it and one of the two is rejected at mount,
and readers verify checksums anyway."""


_GRANT_HEAD = struct.Struct("<BQQQQ")
"""Must match kvpool.common.grants.sign (op, segment_id, offset, length, expiry_ms); a test checks that every
MAC made by Segment.sign verifies with grants.verify."""


class SegmentStatus(IntEnum):
    """Segment status; values match ``kvpool.v1.SegmentStatus`` in master.proto."""

    OK = 1
    DRAINING = 2
    """Readable, takes no new allocations."""
    DRAINED = 3
    """Holds no live object; the store may stop. Not readable."""


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """What a store tells the master about one segment (everything but the secret)."""

    id: int
    node: str
    store_id: str
    size: int
    tcp_endpoint: str
    shm_path: str
    rdma_desc: bytes = b""
    numa_node: int = -1
    tier: int = 0
    """0 = DRAM (takes puts); 1 = the store's SSD tier (only the tier manager allocates there)."""


class StoreEntry:
    """One store: liveness and its queue of free notifications."""

    __slots__ = (
        "store_id",
        "last_seen",
        "segment_ids",
        "_lock",
        "_queue",
        "_next_seq",
        "_limit",
        "dropped",
        "_pending",
    )

    def __init__(self, store_id: str, now: float, seq_base: int, limit: int = FREE_QUEUE_LIMIT) -> None:
        self.store_id = store_id
        self.last_seen = now
        self.segment_ids: set[int] = set()
        self._lock = threading.Lock()
        self._queue: deque[tuple[int, int, int, str]] = deque()  # (segment_id, offset, seq, key)
        self._limit = limit
        self._next_seq = seq_base + 1
        self.dropped = 0
        """Notifications dropped because the queue was full."""
        self._pending: dict[tuple[int, int, str], int] = {}
        """How many queued notifications name each (segment_id, offset, key): what ``free_pending`` asks."""

    def note_freed(self, segment_id: int, offset: int, key: str = "") -> None:
        """Queue the free of the range at ``offset``; ``key`` names the object that held it, so that the
        store forgets only that object (the range may hold a newer one by the time the news arrives)."""
        with self._lock:
            queue = self._queue
            if len(queue) >= self._limit:
                self._unpend(queue.popleft())
                self.dropped += 1
            queue.append((segment_id, offset, self._next_seq, key))
            self._next_seq += 1
            pending = self._pending
            name = (segment_id, offset, key)
            pending[name] = pending.get(name, 0) + 1

    def take(self, ack: int, limit: int) -> list[tuple[int, int, int, str]]:
        """Forget notifications with seq <= ``ack``; return up to ``limit`` pending ones, oldest first."""
        with self._lock:
            queue = self._queue
            while queue and queue[0][2] <= ack:
                self._unpend(queue.popleft())
            return list(islice(queue, limit))

    def free_pending(self, segment_id: int, offset: int, key: str) -> bool:
        """Whether a notification of the free of ``key`` at ``offset`` is queued and not yet acknowledged:
        until it is, the store may still apply it, and it would forget a new copy of ``key`` written
        there (decision 0082). A dict lookup, atomic under the GIL: no lock on the put path."""
        return (segment_id, offset, key) in self._pending

    def _unpend(self, notification: tuple[int, int, int, str]) -> None:
        segment_id, offset, _seq, key = notification
        name = (segment_id, offset, key)
        left = self._pending[name] - 1
        if left:
            self._pending[name] = left
        else:
            del self._pending[name]

    def pending(self) -> int:
        return len(self._queue)


class Segment:
    """One mounted segment. ``info`` and ``secret`` never change; ``status`` changes under the membership
    lock."""

    __slots__ = (
        "info",
        "id",
        "node",
        "store_id",
        "size",
        "tcp_endpoint",
        "shm_path",
        "secret",
        "allocator",
        "store",
        "status",
        "readable",
        "removed",
        "suspected",
        "tier",
        "_mac_base",
    )

    def __init__(self, info: SegmentInfo, secret: bytes, store: StoreEntry, alignment: int = 64) -> None:
        self.info = info
        # Flattened copies of the hot fields (one attribute load instead of two on the hot paths).
        self.id = info.id
        self.node = info.node
        self.store_id = info.store_id
        self.size = info.size
        self.tcp_endpoint = info.tcp_endpoint
        self.shm_path = info.shm_path
        self.secret = secret
        self.allocator = OffsetAllocator(info.size, alignment)
        self.store = store
        self.status = SegmentStatus.OK
        self.readable = True
        self.tier = info.tier
        self.suspected = False
        """Its store is suspected dead (master/suspicion.py): neither readable nor allocatable meanwhile."""
        self.removed = False
        """Set (before its replicas are dropped) when the segment leaves the table; checked under shard
        locks by put_start's insert so that no replica on a removed segment is ever published."""
        # Keyed BLAKE2b state after absorbing the key block: copying it skips one compression per grant.
        self._mac_base = hashlib.blake2b(key=secret, digest_size=grants.MAC_BYTES)

    def sign(self, op: grants.GrantOp, offset: int, length: int, expiry_ms: int, key: bytes) -> bytes:
        """The same MAC as ``grants.sign(self.secret, op, self.id, offset, length, expiry_ms, key)``."""
        mac = self._mac_base.copy()
        mac.update(_GRANT_HEAD.pack(op, self.id, offset, length, expiry_ms) + key)
        return mac.digest()

    def allocate_for(self, key: str, size: int) -> int | None:
        """A range of ``size`` bytes for an object of ``key``, or None when none fits.

        Never a range whose free of the same key the store has not acknowledged yet (decision 0082): the
        free names the key, and a store that applied it after the new copy was written would forget the
        new copy. Such a range is held while another is taken, then given back (unused, no notification).
        """
        allocator = self.allocator
        held: list[int] = []
        try:
            while True:  # each pass holds one more range, so this ends when the segment is full at the latest
                offset = allocator.allocate(size)
                if offset is None or not self.store.free_pending(self.id, offset, key):
                    return offset
                held.append(offset)
        finally:
            for unused in held:
                allocator.free(unused)

    @property
    def free_bytes(self) -> int:
        return self.allocator.free_bytes

    def set_status(self, status: SegmentStatus) -> None:
        self.status = status
        self.readable = status in (SegmentStatus.OK, SegmentStatus.DRAINING) and not self.suspected

    def note_freed(self, offset: int, key: str = "") -> None:
        """Queue a free notification for the owning store (not for a segment that is already gone).

        SSD-tier ranges are not notified here: their allocator queues a DELETE task in the store's tier
        channel instead, in order with the writes into that range (master/tiering.py)."""
        if not self.removed and not self.tier:
            self.store.note_freed(self.id, offset, key)


class SegmentTable:
    """Segments by id and stores by id. Mutate only under the master's membership lock."""

    def __init__(self, alignment: int = 64) -> None:
        self.alignment = alignment
        self.by_id: dict[int, Segment] = {}
        self.stores: dict[str, StoreEntry] = {}
        self.allocatable: tuple[Segment, ...] = ()
        """Segments with status OK, in mount order (the tuple is replaced, never mutated)."""

    def get(self, segment_id: int) -> Segment | None:
        return self.by_id.get(segment_id)

    def store(self, store_id: str) -> StoreEntry | None:
        return self.stores.get(store_id)

    def ensure_store(self, store_id: str, now: float, seq_base: int) -> StoreEntry:
        entry = self.stores.get(store_id)
        if entry is None:
            entry = StoreEntry(store_id, now, seq_base)
            self.stores[store_id] = entry
        return entry

    def add(self, info: SegmentInfo, secret: bytes, store: StoreEntry) -> Segment:
        """Insert a segment, readable at once but not allocatable until ``publish()``."""
        segment = Segment(info, secret, store, self.alignment)
        self.by_id[info.id] = segment
        store.segment_ids.add(info.id)
        return segment

    def remove(self, segment_id: int) -> Segment | None:
        segment = self.by_id.pop(segment_id, None)
        if segment is not None:
            segment.removed = True
            segment.readable = False
            segment.store.segment_ids.discard(segment_id)
        return segment

    def remove_store(self, store_id: str) -> StoreEntry | None:
        return self.stores.pop(store_id, None)

    def publish(self) -> None:
        """Recompute the allocatable tuple after a mount, unmount or status change. SSD-tier segments are
        never allocatable for puts (and not part of the DRAM watermark)."""
        self.allocatable = tuple(
            s for s in self.by_id.values() if s.status == SegmentStatus.OK and not s.tier and not s.suspected
        )

    def segments(self) -> list[Segment]:
        return list(self.by_id.values())
