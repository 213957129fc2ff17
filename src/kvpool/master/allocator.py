"""Master-side offset allocator: one per segment, best fit over free extents with coalescing.

The master hands out (segment, offset) ranges so that a client can write with a one-sided transfer and no
store CPU (docs/architecture.md). The allocator never touches memory; it only does bookkeeping over ``[0, size)``.

Data structures (all guarded by one lock per allocator, the innermost lock of the master):

* ``_starts``: sorted start offsets of the free extents, so that ``free`` finds its neighbours with one
  ``bisect`` and coalesces in O(1) list surgery, and ``reserve`` finds the extent that contains a range.
* ``_free``: start -> length of every free extent.
* ``_bins``: exact length -> insertion-ordered set of the starts of free extents of that length, and
  ``_lengths``: the sorted distinct lengths that have a bin. Best fit is ``bisect_left(_lengths, need)``,
  and with uniform object sizes every freed block lands in the one bin of that size and is reused as an
  exact fit, so the steady state of a KV-page workload is O(1)-ish and leaves no fragments.
* ``_alloc``: start -> block length of every allocation. The key is the very int returned by ``allocate``
  (or passed to ``reserve``), so a caller that keeps it (the master's ObjectMeta.offset) shares it.

Lengths are rounded up to ``alignment`` (64 by default: a cache line, and what RDMA NICs like); every
extent start stays aligned. A block at the very end of an unaligned segment may be shorter than the rounded
length (it is clipped at ``size``).

Exhaustion is not an error: ``allocate`` returns None and the caller evicts or tries another segment.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass

__all__ = ["AllocatorStats", "OffsetAllocator"]

_INTERN_LIMIT = 4096


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """A consistent snapshot of one allocator (taken under its lock)."""

    size: int
    used: int
    free_bytes: int
    largest_free: int
    free_extents: int
    allocations: int
    alignment: int
    failures: int
    """Calls to ``allocate`` that returned None since creation."""

    @property
    def utilisation(self) -> float:
        return self.used / self.size if self.size else 0.0

    @property
    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when all free space is one extent."""
        return 1.0 - self.largest_free / self.free_bytes if self.free_bytes else 0.0


class OffsetAllocator:
    """Best-fit allocator of aligned ranges inside ``[0, size)``; thread-safe (its own lock)."""

    def __init__(self, size: int, alignment: int = 64) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self._size = size
        self._alignment = alignment
        self._mask = alignment - 1
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._free: dict[int, int] = {}
        self._bins: dict[int, dict[int, None]] = {}
        self._lengths: list[int] = []
        self._alloc: dict[int, int] = {}
        self._used = 0
        self._failures = 0
        self._interned: dict[int, int] = {}
        if size:
            self._starts.append(0)
            self._add_extent_meta(0, size)

    # ---------------------------------------------------------------- properties (lock-free int reads)

    @property
    def size(self) -> int:
        return self._size

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._size - self._used

    @property
    def largest_free(self) -> int:
        lengths = self._lengths
        return lengths[-1] if lengths else 0

    @property
    def allocations(self) -> int:
        return len(self._alloc)

    def statistics(self) -> AllocatorStats:
        with self._lock:
            return AllocatorStats(
                size=self._size,
                used=self._used,
                free_bytes=self._size - self._used,
                largest_free=self._lengths[-1] if self._lengths else 0,
                free_extents=len(self._starts),
                allocations=len(self._alloc),
                alignment=self._alignment,
                failures=self._failures,
            )

    def block_length(self, offset: int) -> int | None:
        """The length reserved at ``offset`` (rounded up, clipped at the end); None if not allocated."""
        return self._alloc.get(offset)

    def allocated_ranges(self) -> dict[int, int]:
        """A copy of offset -> block length of every allocation (for validation and admin)."""
        with self._lock:
            return dict(self._alloc)

    # ---------------------------------------------------------------- operations

    def allocate(self, length: int) -> int | None:
        """Reserve ``length`` bytes (rounded up to the alignment); the offset, or None if nothing fits."""
        if length <= 0:
            raise ValueError(f"length must be > 0, got {length}")
        need = self._intern((length + self._mask) & ~self._mask)
        with self._lock:
            lengths = self._lengths
            i = bisect_left(lengths, need)
            if i == len(lengths):
                self._failures += 1
                return None
            flen = lengths[i]
            start = next(iter(self._bins[flen]))
            self._remove_extent_meta(start, flen)
            if flen > need:
                # The remainder keeps its place in the sorted starts: only its start moves right.
                rest = start + need
                self._starts[bisect_left(self._starts, start)] = rest
                self._add_extent_meta(rest, flen - need)
            else:
                del self._starts[bisect_left(self._starts, start)]
            self._alloc[start] = need
            self._used += need
            return start

    def free(self, offset: int) -> int:
        """Release the block at ``offset`` and coalesce it with free neighbours; returns the block length.

        Raises KeyError if ``offset`` is not the start of an allocated block (a double free is a bug of the
        caller, never silently ignored).
        """
        with self._lock:
            length = self._alloc.pop(offset, None)
            if length is None:
                raise KeyError(f"offset {offset} is not allocated")
            self._used -= length
            self._insert_free(offset, length)
            return length

    def _intern(self, need: int) -> int:
        """One int per block length: a million blocks of one page size then share one int (32 bytes each);
        an index rebuilt from inventories (a re-mount, a warm standby's feed) reserves every block."""
        interned = self._interned.get(need)
        if interned is not None:
            return interned
        if len(self._interned) < _INTERN_LIMIT:
            self._interned[need] = need
        return need

    def reserve(self, offset: int, length: int) -> bool:
        """Claim exactly ``[offset, offset + length)`` (rounded up, clipped at the end).

        Used to rebuild the allocator from a store's inventory. False (and no change) if the offset is not
        aligned, the range is out of bounds, or any part of it is already allocated.
        """
        if offset < 0 or length <= 0 or offset & self._mask or offset + length > self._size:
            return False
        need = self._intern(min((length + self._mask) & ~self._mask, self._size - offset))
        with self._lock:
            starts = self._starts
            i = bisect_right(starts, offset) - 1
            if i < 0:
                return False
            fstart = starts[i]
            flen = self._free[fstart]
            fend = fstart + flen
            end = offset + need
            if end > fend:
                return False
            self._remove_extent_meta(fstart, flen)
            # Replace the extent by up to two pieces, keeping ``_starts`` sorted with at most one insert.
            pieces = []
            if offset > fstart:
                pieces.append((fstart, offset - fstart))
            if fend > end:
                pieces.append((end, fend - end))
            if not pieces:
                del starts[i]
            else:
                starts[i] = pieces[0][0]
                if len(pieces) == 2:
                    starts.insert(i + 1, pieces[1][0])
                for pstart, plen in pieces:
                    self._add_extent_meta(pstart, plen)
            self._alloc[offset] = need
            self._used += need
            return True

    # ---------------------------------------------------------------- invariants (tests, validate())

    def check(self) -> None:
        """Raise AssertionError unless free extents and allocations tile ``[0, size)`` exactly."""
        with self._lock:
            spans = sorted(
                [(s, n, "free") for s, n in self._free.items()] + [(s, n, "alloc") for s, n in self._alloc.items()]
            )
            pos = 0
            prev_free = False
            for start, length, kind in spans:
                if start != pos:
                    raise AssertionError(f"allocator: gap or overlap at {pos} (next span starts at {start})")
                if length <= 0:
                    raise AssertionError(f"allocator: empty {kind} span at {start}")
                if kind == "free" and prev_free:
                    raise AssertionError(f"allocator: adjacent free extents not coalesced at {start}")
                prev_free = kind == "free"
                pos = start + length
            if pos != self._size:
                raise AssertionError(f"allocator: spans end at {pos}, size is {self._size}")
            if self._starts != sorted(self._free):
                raise AssertionError("allocator: sorted starts do not match free extents")
            if self._used != sum(self._alloc.values()):
                total = sum(self._alloc.values())
                raise AssertionError(f"allocator: used {self._used} != sum of blocks {total}")
            binned = {(s, n) for n, bin_ in self._bins.items() for s in bin_}
            if binned != set(self._free.items()):
                raise AssertionError("allocator: size bins do not match free extents")
            if self._lengths != sorted(self._bins) or any(not b for b in self._bins.values()):
                raise AssertionError("allocator: length index does not match bins")
            for start in self._starts:
                if start & self._mask:
                    raise AssertionError(f"allocator: free extent at unaligned offset {start}")

    # ---------------------------------------------------------------- internals (lock held)

    def _add_extent_meta(self, start: int, length: int) -> None:
        self._free[start] = length
        bin_ = self._bins.get(length)
        if bin_ is None:
            self._bins[length] = {start: None}
            insort(self._lengths, length)
        else:
            bin_[start] = None

    def _remove_extent_meta(self, start: int, length: int) -> None:
        del self._free[start]
        bin_ = self._bins[length]
        del bin_[start]
        if not bin_:
            del self._bins[length]
            del self._lengths[bisect_left(self._lengths, length)]

    def _insert_free(self, start: int, length: int) -> None:
        """Add ``[start, start+length)`` to the free extents, merging with the extents that touch it."""
        starts = self._starts
        free = self._free
        end = start + length
        i = bisect_left(starts, start)
        right_len = free.get(end) if i < len(starts) and starts[i] == end else None
        left_start = starts[i - 1] if i > 0 else -1
        left_len = free[left_start] if left_start >= 0 and left_start + free[left_start] == start else None
        if right_len is not None:
            self._remove_extent_meta(end, right_len)
            length += right_len
        if left_len is not None:
            self._remove_extent_meta(left_start, left_len)
            self._add_extent_meta(left_start, left_len + length)
            if right_len is not None:
                del starts[i]  # the right extent's start; the left one's stays
        else:
            self._add_extent_meta(start, length)
            if right_len is not None:
                starts[i] = start  # the right extent now begins earlier
            else:
                starts.insert(i, start)
