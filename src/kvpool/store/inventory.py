"""The store's inventory: which objects are fully written where, so a new master can rebuild its index.

Stores are the source of truth for what they hold (decision 0003, "no cache loss on failover"): a leader that
starts or takes over asks every store for its inventory and rebuilds the index and the allocators from it.
So the inventory must never describe bytes that are not that object's bytes:

* an entry appears only when every byte of the object arrived. Parts of a striped write come over several
  connections, in any order, and may be re-sent after a timeout, so we track the received part *intervals*
  (a byte counter would count a re-sent part twice);
* a write into a range first drops every entry and every partial write it overlaps (``begin_write``, called
  before the bytes land), so no entry ever describes overwritten bytes. A re-sent part of the same object
  (same key, offset, length and checksum) keeps its entry: it rewrites identical bytes;
* ranges the master freed are dropped with :meth:`Inventory.drop`, which forgets only the object the master
  names: the master may have handed the range to a new object, written and committed here, before the
  news of the free arrived.

Memory for incomplete writes is bounded: a partial write is forgotten after ``partial_timeout_s`` without a
new part, when it is overwritten, or when more than ``max_partials`` are pending (oldest first).

Per segment, all *claims* (committed entries and partial writes) are kept non-overlapping and sorted by
offset, so the claims a new write overlaps are found with a bisect and a short walk back.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field

from kvpool.common.clock import SYSTEM_CLOCK, Clock


@dataclass(frozen=True, slots=True)
class InventoryEntry:
    """One fully written object: what a store reports to a (new) master."""

    segment_id: int
    key: bytes
    offset: int
    length: int
    checksum: int


@dataclass(slots=True)
class _Claim:
    """An object's range on a segment: committed (``entry`` set) or still being written."""

    key: bytes
    offset: int
    length: int
    checksum: int
    received: list[tuple[int, int]] = field(default_factory=list)  # sorted, disjoint [start, end)
    touched: float = 0.0
    entry: InventoryEntry | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def same_object(self, key: bytes, offset: int, length: int, checksum: int) -> bool:
        return self.offset == offset and self.length == length and self.key == key and self.checksum == checksum

    def add_interval(self, start: int, end: int) -> bool:
        """Merge [start, end) into the received set; True when [0, length) is covered."""
        merged: list[tuple[int, int]] = []
        placed = False
        for lo, hi in self.received:
            if hi < start:
                merged.append((lo, hi))
            elif lo > end:
                if not placed:
                    merged.append((start, end))
                    placed = True
                merged.append((lo, hi))
            else:  # touching or overlapping: absorb
                start, end = min(lo, start), max(hi, end)
        if not placed:
            merged.append((start, end))
        self.received = merged
        return merged[0] == (0, self.length) if merged else self.length == 0


class _SortedInts:
    """A sorted multiset-free list of ints, kept in chunks so an insert or remove moves at most a chunk
    (a flat list would memmove the whole tail: milliseconds per write once a segment holds ~1M objects)."""

    _CHUNK = 512

    def __init__(self) -> None:
        self._chunks: list[list[int]] = []
        self._maxes: list[int] = []  # last value of each chunk

    def add(self, value: int) -> None:
        if not self._chunks:
            self._chunks.append([value])
            self._maxes.append(value)
            return
        i = min(bisect.bisect_left(self._maxes, value), len(self._chunks) - 1)
        chunk = self._chunks[i]
        bisect.insort(chunk, value)
        self._maxes[i] = chunk[-1]
        if len(chunk) > 2 * self._CHUNK:
            half = len(chunk) // 2
            self._chunks[i : i + 1] = [chunk[:half], chunk[half:]]
            self._maxes[i : i + 1] = [chunk[half - 1], chunk[-1]]

    def remove(self, value: int) -> None:
        i = bisect.bisect_left(self._maxes, value)
        chunk = self._chunks[i]
        del chunk[bisect.bisect_left(chunk, value)]
        if chunk:
            self._maxes[i] = chunk[-1]
        else:
            del self._chunks[i]
            del self._maxes[i]

    def below(self, bound: int) -> Iterator[int]:
        """Values < ``bound``, largest first."""
        i = bisect.bisect_left(self._maxes, bound)
        if i < len(self._chunks):
            chunk = self._chunks[i]
            for j in range(bisect.bisect_left(chunk, bound) - 1, -1, -1):
                yield chunk[j]
        for k in range(min(i, len(self._chunks)) - 1, -1, -1):
            yield from reversed(self._chunks[k])

    def __iter__(self) -> Iterator[int]:
        for chunk in self._chunks:
            yield from chunk


class _SegmentClaims:
    """Non-overlapping claims of one segment, sorted by offset."""

    def __init__(self) -> None:
        self.starts = _SortedInts()
        self.by_offset: dict[int, _Claim] = {}
        self.committed = 0

    def overlapping(self, offset: int, length: int) -> list[_Claim]:
        end = offset + max(length, 1)  # a zero-length object still owns its offset
        found: list[_Claim] = []
        for start in self.starts.below(end):
            claim = self.by_offset[start]
            if max(claim.end, claim.offset + 1) <= offset:
                break  # claims are disjoint and sorted, so every earlier one ends earlier too
            found.append(claim)
        return found

    def insert(self, claim: _Claim) -> None:
        self.starts.add(claim.offset)
        self.by_offset[claim.offset] = claim

    def remove(self, claim: _Claim) -> None:
        del self.by_offset[claim.offset]
        self.starts.remove(claim.offset)
        if claim.entry is not None:
            self.committed -= 1


class Inventory:
    """Thread-safe map of fully written objects per segment, keyed by offset."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK, partial_timeout_s: float = 60.0, max_partials: int = 65536) -> None:
        self._clock = clock
        self._partial_timeout_s = partial_timeout_s
        self._max_partials = max_partials
        self._lock = threading.Lock()
        self._segments: dict[int, _SegmentClaims] = {}
        # (segment_id, offset) -> claim, least recently touched first: expiry is a pop from the front
        self._partials: OrderedDict[tuple[int, int], _Claim] = OrderedDict()
        self._committed = 0
        self._by_key: dict[bytes, list[InventoryEntry]] = {}
        """Committed entries by key, oldest first (what a read by key finds: decision 0031)."""
        self.listener: Callable[[InventoryEntry, bool], None] | None = None
        """Told of every entry committed (False) or forgotten (True), in order, under the lock; must be
        quick (the warm-standby feed appends to its journal: store/standby_feed.py)."""

    # ------------------------------------------------------------------ writes
    def begin_write(self, segment_id: int, offset: int, length: int, key: bytes, checksum: int) -> None:
        """A part of object (key, offset, length, checksum) is about to be written: drop what it overwrites.

        Called before the bytes land, so a concurrent inventory report never lists overwritten bytes.
        """
        with self._lock:
            self._claim(segment_id, offset, length, key, checksum)
            self._expire_partials()

    def record_part(
        self,
        segment_id: int,
        offset: int,
        length: int,
        key: bytes,
        checksum: int,
        part_offset: int,
        part_length: int,
    ) -> bool:
        """Bytes [part_offset, part_offset + part_length) of the object arrived; True if it is now complete
        (its entry was added by this call)."""
        if part_offset < 0 or part_length < 0 or part_offset + part_length > length:
            raise ValueError(f"part [{part_offset}, +{part_length}) outside object of {length} bytes")
        with self._lock:
            claim = self._claim(segment_id, offset, length, key, checksum)
            completed = False
            if claim.entry is None and claim.add_interval(part_offset, part_offset + part_length):
                self._commit(segment_id, claim)
                completed = True
            self._expire_partials()
            return completed

    def begin_writes(self, parts: list[tuple[int, int, int, bytes, int]]) -> None:
        """``begin_write`` of each (segment_id, offset, length, key, checksum), under one lock: the entries
        of one WRITEV frame."""
        with self._lock:
            for segment_id, offset, length, key, checksum in parts:
                self._claim(segment_id, offset, length, key, checksum)
            self._expire_partials()

    def record_parts(self, parts: list[tuple[int, int, int, bytes, int, int, int]]) -> None:
        """``record_part`` of each (segment_id, offset, length, key, checksum, part_offset, part_length),
        under one lock: the entries of one WRITEV frame, every one of them inside its object."""
        for _, _, length, _, _, part_offset, part_length in parts:
            if part_offset < 0 or part_length < 0 or part_offset + part_length > length:
                raise ValueError(f"part [{part_offset}, +{part_length}) outside object of {length} bytes")
        with self._lock:
            for segment_id, offset, length, key, checksum, part_offset, part_length in parts:
                claim = self._claim(segment_id, offset, length, key, checksum)
                if claim.entry is None and claim.add_interval(part_offset, part_offset + part_length):
                    self._commit(segment_id, claim)
            self._expire_partials()

    def _claim(self, segment_id: int, offset: int, length: int, key: bytes, checksum: int) -> _Claim:
        """The claim of this object, created (dropping everything it overlaps) if it is new."""
        claims = self._segments.get(segment_id)
        if claims is None:
            claims = self._segments[segment_id] = _SegmentClaims()
        existing = claims.by_offset.get(offset)
        now = self._clock.monotonic()
        if existing is not None and existing.same_object(key, offset, length, checksum):
            if existing.entry is None:  # still partial: it is alive, move it to the young end
                existing.touched = now
                self._partials.move_to_end((segment_id, offset))
            return existing
        for old in claims.overlapping(offset, length):
            self._forget(segment_id, claims, old)
        claim = _Claim(key, offset, length, checksum, touched=now)
        claims.insert(claim)
        self._partials[(segment_id, offset)] = claim
        return claim

    def _commit(self, segment_id: int, claim: _Claim) -> None:
        claim.entry = InventoryEntry(segment_id, claim.key, claim.offset, claim.length, claim.checksum)
        claim.received = []
        del self._partials[(segment_id, claim.offset)]
        self._segments[segment_id].committed += 1
        self._committed += 1
        self._by_key.setdefault(claim.key, []).append(claim.entry)
        if self.listener is not None:
            self.listener(claim.entry, False)

    def _forget(self, segment_id: int, claims: _SegmentClaims, claim: _Claim) -> None:
        claims.remove(claim)
        if claim.entry is None:
            self._partials.pop((segment_id, claim.offset), None)
        else:
            self._committed -= 1
            self._unindex(claim.entry)
            if self.listener is not None:
                self.listener(claim.entry, True)

    def _unindex(self, entry: InventoryEntry) -> None:
        same_key = self._by_key.get(entry.key)
        if same_key is None:
            return
        same_key[:] = [e for e in same_key if e is not entry]
        if not same_key:
            del self._by_key[entry.key]

    def _expire_partials(self) -> None:
        horizon = self._clock.monotonic() - self._partial_timeout_s
        while self._partials:
            (segment_id, _offset), oldest = next(iter(self._partials.items()))
            if oldest.touched > horizon and len(self._partials) <= self._max_partials:
                return
            self._forget(segment_id, self._segments[segment_id], oldest)

    # ------------------------------------------------------------------ master-driven changes
    def drop(self, segment_id: int, offset: int, key: bytes = b"") -> bool:
        """The master freed object ``key`` at ``offset``: forget it (and any partial write of it there).

        A claim of another key at that offset is a newer object in the reused range: it stays. An empty
        ``key`` (a master that does not name the object) forgets whatever is there."""
        with self._lock:
            claims = self._segments.get(segment_id)
            claim = claims.by_offset.get(offset) if claims else None
            if claims is None or claim is None or (key and claim.key != key):
                return False
            self._forget(segment_id, claims, claim)
            return True

    def drop_segment(self, segment_id: int) -> int:
        """Forget a whole segment (unmounted); returns how many committed entries it had."""
        with self._lock:
            claims = self._segments.pop(segment_id, None)
            if claims is None:
                return 0
            for key in [k for k in self._partials if k[0] == segment_id]:
                del self._partials[key]
            self._committed -= claims.committed
            for claim in claims.by_offset.values():
                if claim.entry is not None:
                    self._unindex(claim.entry)
            return claims.committed

    # ------------------------------------------------------------------ reports
    def holds(self, segment_id: int, offset: int, length: int, key: bytes, checksum: int) -> bool:
        """Whether exactly this object is fully written at ``offset`` (and nothing has begun overwriting
        it): what a revalidated read, whose grant has ended, is served on."""
        with self._lock:
            claims = self._segments.get(segment_id)
            claim = claims.by_offset.get(offset) if claims else None
            return claim is not None and claim.entry is not None and claim.same_object(key, offset, length, checksum)

    def find(self, key: bytes, segments: Container[int]) -> InventoryEntry | None:
        """The most recently committed object held under ``key`` on one of ``segments``, untouched since
        it was written, or None: what a read by key (decision 0031) is served from."""
        with self._lock:
            for entry in reversed(self._by_key.get(key, ())):
                if entry.segment_id in segments:
                    return entry
            return None

    def entries(self, segment_id: int) -> list[InventoryEntry]:
        """Committed objects of one segment, by offset."""
        with self._lock:
            claims = self._segments.get(segment_id)
            if claims is None:
                return []
            found = (claims.by_offset[s].entry for s in claims.starts)
            return [e for e in found if e is not None]

    def segment_ids(self) -> list[int]:
        with self._lock:
            return list(self._segments)

    def pending(self) -> int:
        """Partial (incomplete) writes currently tracked."""
        with self._lock:
            return len(self._partials)

    def __len__(self) -> int:
        with self._lock:
            return self._committed
