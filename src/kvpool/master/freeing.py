"""Freeing in the master's state: unlink an object and free its ranges (``_drop_if``), resolve an object's
blocks (``_ranges_of``), free ranges with their store notifications (``_free_ranges``), and the periodic
reclaim of abandoned puts (with the release of revoked puts' quarantined ranges).

A mixin of ``MasterState`` (state.py), not a separate object: removal, eviction, the tier manager and the
move engine (moves.py calls ``state._free_ranges``) all free through these methods, which work on the
state's own shards, stripes, table, quarantine, counters and change listener. The attributes they use are
declared below and assigned by ``MasterState.__init__``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvpool.common.clock import Clock
from kvpool.common.log import get_logger
from kvpool.master.config import MasterConfig
from kvpool.master.objects import COMPLETE, MAX_OFFSET, PRIMARY_COMPLETE, SEGMENT_SHIFT, ObjectMeta
from kvpool.master.quarantine import RangeQuarantine
from kvpool.master.segments import Segment, SegmentTable
from kvpool.master.shards import Shard, ShardMap, StripedLocks

__all__ = ["RECLAIM_GRACE_S", "FreeingMixin", "Range"]

_log = get_logger(__name__)

RECLAIM_GRACE_S = 5.0
"""Extra wait before the periodic reclaim reuses an abandoned put's ranges: the writer's WRITE grant
(expiry = put_start + put_timeout_s) has then surely expired on the store, even with some clock skew."""

_SEG_SHIFT = SEGMENT_SHIFT  # packed extra replica: segment_id << 57 | offset << 1 | complete
_OFF_MASK = MAX_OFFSET
_READABLE_MASK = COMPLETE | PRIMARY_COMPLETE

Range = tuple[Segment, int]
"""(segment, offset) of one allocated block."""


class FreeingMixin:
    """Unlink-and-free of objects, and the reclaim of abandoned puts (see the module docstring)."""

    _cfg: MasterConfig
    _clock: Clock
    _shards: ShardMap
    _stripes: StripedLocks
    _table: SegmentTable
    _quarantine: RangeQuarantine
    _stats_lock: threading.Lock
    _reclaimed: int
    on_change: Callable[[Sequence[str], Sequence[str]], None] | None

    def reclaim_abandoned_puts(self) -> int:
        """Free the puts still PROCESSING put_timeout_s + RECLAIM_GRACE_S after they started."""
        cutoff = self._clock.monotonic() - (self._cfg.put_timeout_s + RECLAIM_GRACE_S)
        for key, ranges in self._quarantine.due_by_key(self._clock.monotonic()):  # revoked puts', now safe
            self._free_ranges(ranges, key)

        def abandoned(meta: ObjectMeta) -> bool:
            return not meta.flags & COMPLETE and meta.put_time < cutoff

        reclaimed = 0
        for shard in self._shards:
            if not shard.processing:
                continue
            with shard.lock:
                objects = shard.objects
                keys = [k for k in shard.processing if (m := objects.get(k)) is not None and abandoned(m)]
            for key in keys:
                if self._drop_if(key, abandoned, shard) is not None:
                    reclaimed += 1
        if reclaimed:
            with self._stats_lock:
                self._reclaimed += reclaimed
            _log.info("reclaimed %d abandoned puts", reclaimed)
        return reclaimed

    # =================================================================== internals: freeing

    def _shard_or_none(self, key: str) -> Shard | None:
        try:
            return self._shards.shard_of(key.encode())
        except (AttributeError, UnicodeEncodeError):
            return None

    def _drop_if(
        self, key: str, predicate: Callable[[ObjectMeta], bool], shard: Shard | None = None
    ) -> ObjectMeta | None:
        """Under the key's stripe: if the object exists and ``predicate`` holds, unlink it and free its
        ranges. Returns the dropped object (None if absent or refused)."""
        if shard is None:
            shard = self._shard_or_none(key)
            if shard is None:
                return None
        with self._stripes.lock_for(key):
            with shard.lock:
                meta = shard.objects.get(key)
                if meta is None or not predicate(meta):
                    return None
                del shard.objects[key]
                shard.processing.pop(key, None)
                ranges = self._ranges_of(meta)
            self._free_ranges(ranges, key)
        if self.on_change is not None and meta.flags & _READABLE_MASK:
            self.on_change((), (key,))
        return meta

    def _ranges_of(self, meta: ObjectMeta) -> list[Range]:
        """The object's blocks, resolved to Segment objects. Call under the shard lock: an unmount strips
        replicas under the shard locks, so a replica seen here belongs to the segment now in the table (never
        to a later segment re-mounted with the same id)."""
        by_id = self._table.by_id
        out: list[Range] = []
        seg = by_id.get(meta.segment)
        if seg is not None:
            out.append((seg, meta.offset))
        if meta.extra is not None:
            for r in meta.extra:
                seg = by_id.get(r >> _SEG_SHIFT)
                if seg is not None:
                    out.append((seg, (r >> 1) & _OFF_MASK))
        return out

    def _free_ranges(self, ranges: list[Range], key: str = "") -> None:
        for seg, offset in ranges:
            try:
                seg.allocator.free(offset)
            except KeyError:
                # A double free is a bug; keep serving and let validate() point at it.
                _log.error("segment %d: freeing unallocated offset %d", seg.id, offset)
                continue
            seg.note_freed(offset, key)
