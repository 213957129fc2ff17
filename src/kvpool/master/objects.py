"""Compact per-object metadata and replica records.

The master holds one ``ObjectMeta`` per object; at a million objects every byte counts. Target: <= 400 bytes
per object including the key, the shard dict entry and the allocator's record of the block (measured: see
the report in tests/unit/master/test_master_state.py::test_memory_per_object_is_under_400_bytes). Hence:

* ``__slots__`` and no per-object dict: eight slots, a 96-byte record (``ObjectMeta``'s docstring).
* The first (usually only) replica is inline: ``segment`` and ``offset`` slots, its status a flag bit. The
  ``offset`` int is the very object the segment's allocator keeps as its dict key (``allocate``/``reserve``
  return it), so it is stored once for both.
* Further replicas (replica_num > 1, or a copy being added by a drain) are packed ints in ``extra``:
  ``segment_id << 57 | offset << 1 | complete``; ``Replica`` is the readable view. They and a soft pin
  are rare, so they live out of line (``_Rare``), in the slot that otherwise holds the lease's end.
* The replica length is the object's ``size`` (one contiguous buffer per replica, as in Mooncake); the
  master interns sizes so that the objects of one page size share one int.
* Timestamps are floats from the master's monotonic clock; a batch call computes ``now`` once, so the objects
  of one batch share one float.
* The writer of an unfinished put is kept in the shard's processing map, not here: it is needed only while
  the put is in flight.

A replica can be PROCESSING while its object is COMPLETE: later work (drain, re-replication) adds a replica
on another segment while the first one stays readable, and flips it to COMPLETE when the copy is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple

__all__ = [
    "COMPLETE",
    "HARD_PIN",
    "MAX_OFFSET",
    "PRIMARY_COMPLETE",
    "ObjectMeta",
    "Replica",
    "ReplicaStatus",
    "pack_replica",
    "unpack_replica",
]

# Object flags (ObjectMeta.flags).
COMPLETE = 1
"""put_end has run: the object is visible to readers (each replica carries its own status)."""
HARD_PIN = 2
"""Never evicted; removed only by remove(force=True)."""
PRIMARY_COMPLETE = 4
"""Status of the inline replica: set = COMPLETE, clear = PROCESSING."""

_OFFSET_BITS = 56
SEGMENT_SHIFT = _OFFSET_BITS + 1
MAX_OFFSET = (1 << _OFFSET_BITS) - 1
"""Largest offset a packed replica can hold (64 PiB); segment sizes are validated against it at mount."""


class ReplicaStatus(IntEnum):
    """Status of one replica (the design's PROCESSING | COMPLETE)."""

    PROCESSING = 1
    COMPLETE = 2


class Replica(NamedTuple):
    """Readable view of one replica."""

    segment_id: int
    offset: int
    status: ReplicaStatus

    @property
    def complete(self) -> bool:
        return self.status == ReplicaStatus.COMPLETE


def pack_replica(segment_id: int, offset: int, complete: bool) -> int:
    """Pack (segment, offset, status) into one int; ``0 <= offset <= MAX_OFFSET``, ``segment_id >= 0``."""
    if segment_id < 0 or not 0 <= offset <= MAX_OFFSET:
        raise ValueError(f"cannot pack replica segment={segment_id} offset={offset}")
    return (segment_id << SEGMENT_SHIFT) | (offset << 1) | (1 if complete else 0)


def unpack_replica(packed: int) -> Replica:
    return Replica(
        packed >> SEGMENT_SHIFT,
        (packed >> 1) & MAX_OFFSET,
        ReplicaStatus.COMPLETE if packed & 1 else ReplicaStatus.PROCESSING,
    )


class _Rare:
    """The fields few objects need, out of line: further replicas and a soft pin (with the lease beside
    them, so that one slot of ObjectMeta holds all three)."""

    __slots__ = ("extra", "soft_pin_until", "lease_until")

    def __init__(self, extra: tuple[int, ...] | None, soft_pin_until: float, lease_until: float) -> None:
        self.extra = extra
        self.soft_pin_until = soft_pin_until
        self.lease_until = lease_until


class ObjectMeta:
    """Metadata of one object. Fields are read and written under the object's shard lock.

    Eight slots: with its GC and object headers the record is 96 bytes (pymalloc's 16-byte size classes;
    nine or ten slots both take 112). ``extra``, ``soft_pin_until`` and ``lease_until`` share the slot
    ``_hold``: a float (the lease's end) while the object has one replica and no soft pin, as nearly all
    objects do, else a ``_Rare`` holding all three. They read and write as attributes either way."""

    __slots__ = (
        "size",
        "checksum",
        "segment",
        "offset",
        "last_access",
        "put_time",
        "flags",
        "_hold",
    )

    size: int
    checksum: int
    segment: int
    """Segment id of the inline (first) replica."""
    offset: int
    """Offset of the inline replica (the allocator's own key int: shared, not copied)."""
    last_access: float
    """Monotonic time of the last put_end / get / exists hit (the LRU key)."""
    put_time: float
    """Monotonic time of put_start while PROCESSING, of put_end once COMPLETE (the FIFO key)."""
    flags: int
    _hold: float | _Rare
    """The lease's end, or a _Rare with the lease, further replicas and a soft pin (see above)."""

    def __init__(
        self,
        size: int,
        segment: int,
        offset: int,
        now: float,
        flags: int = 0,
        checksum: int = 0,
        soft_pin_until: float = 0.0,
    ) -> None:
        self.size = size
        self.checksum = checksum
        self.segment = segment
        self.offset = offset
        self.last_access = now
        self.put_time = now
        self.flags = flags
        self._hold = _Rare(None, soft_pin_until, 0.0) if soft_pin_until else 0.0

    @property
    def extra(self) -> tuple[int, ...] | None:
        """Packed further replicas, None when there is only the inline one."""
        hold = self._hold
        return hold.extra if isinstance(hold, _Rare) else None

    @extra.setter
    def extra(self, extra: tuple[int, ...] | None) -> None:
        hold = self._hold
        if isinstance(hold, _Rare):
            hold.extra = extra
            self._compact(hold)
        elif extra is not None:
            self._hold = _Rare(extra, 0.0, hold)

    @property
    def lease_until(self) -> float:
        """Monotonic end of the read lease (0.0 = never leased); protects against eviction and removal."""
        hold = self._hold
        return hold.lease_until if isinstance(hold, _Rare) else hold

    @lease_until.setter
    def lease_until(self, until: float) -> None:
        hold = self._hold
        if isinstance(hold, _Rare):
            hold.lease_until = until
        else:
            self._hold = until

    @property
    def soft_pin_until(self) -> float:
        """Monotonic end of the soft pin, 0.0 = none."""
        hold = self._hold
        return hold.soft_pin_until if isinstance(hold, _Rare) else 0.0

    @soft_pin_until.setter
    def soft_pin_until(self, until: float) -> None:
        hold = self._hold
        if isinstance(hold, _Rare):
            hold.soft_pin_until = until
            self._compact(hold)
        elif until:
            self._hold = _Rare(None, until, hold)

    def extend_lease(self, until: float) -> float:
        """Move the lease's end to ``until`` if that is later; the lease's end after (the read path's one
        call instead of a read, a compare and a write through the property)."""
        hold = self._hold
        if isinstance(hold, _Rare):
            if hold.lease_until < until:
                hold.lease_until = until
            return hold.lease_until
        if hold < until:
            self._hold = hold = until
        return hold

    def _compact(self, hold: _Rare) -> None:
        """Back to the inline float once neither further replicas nor a soft pin are left."""
        if hold.extra is None and not hold.soft_pin_until:
            self._hold = hold.lease_until

    @property
    def complete(self) -> bool:
        return bool(self.flags & COMPLETE)

    @property
    def hard_pinned(self) -> bool:
        return bool(self.flags & HARD_PIN)

    def replica_count(self) -> int:
        extra = self.extra
        return 1 if extra is None else 1 + len(extra)

    def replica_list(self) -> list[Replica]:
        """Every replica, the inline one first."""
        first = Replica(
            self.segment,
            self.offset,
            ReplicaStatus.COMPLETE if self.flags & PRIMARY_COMPLETE else ReplicaStatus.PROCESSING,
        )
        if self.extra is None:
            return [first]
        return [first, *(unpack_replica(r) for r in self.extra)]

    def set_replicas(self, replicas: Sequence[Replica]) -> None:
        """Replace the replica set (non-empty); keeps the inline offset int if the first one is unchanged."""
        if not replicas:
            raise ValueError("an object needs at least one replica")
        first = replicas[0]
        if first.segment_id != self.segment or first.offset != self.offset:
            self.segment = first.segment_id
            self.offset = first.offset
        if first.complete:
            self.flags |= PRIMARY_COMPLETE
        else:
            self.flags &= ~PRIMARY_COMPLETE
        rest = replicas[1:]
        self.extra = tuple(pack_replica(r.segment_id, r.offset, r.complete) for r in rest) if rest else None

    def add_replica(self, segment_id: int, offset: int, complete: bool) -> None:
        packed = pack_replica(segment_id, offset, complete)
        self.extra = (packed,) if self.extra is None else (*self.extra, packed)

    def mark_all_complete(self) -> None:
        self.flags |= COMPLETE | PRIMARY_COMPLETE
        if self.extra is not None:
            self.extra = tuple(r | 1 for r in self.extra)

    def all_replicas_complete(self) -> bool:
        if not self.flags & PRIMARY_COMPLETE:
            return False
        extra = self.extra
        return extra is None or all(r & 1 for r in extra)

    def __repr__(self) -> str:
        state = "COMPLETE" if self.flags & COMPLETE else "PROCESSING"
        return (
            f"ObjectMeta(size={self.size}, {state}, replicas={self.replica_list()}, "
            f"last_access={self.last_access}, lease_until={self.lease_until}, flags={self.flags})"
        )
