"""Reports and invariants of the master's state: ``stats`` (counters and usage), ``segments`` (the admin view of
every mounted segment) and ``validate`` (every invariant of the index, the allocators and the table; tests).

A mixin of ``MasterState`` (state.py), not a separate object, because it has no state of its own: it reads
every private part of the state (shards, table, quarantine, counters) under the state's own locks, and a
check of the whole object is clearest written against that object. The attributes it reads are declared
below and assigned by ``MasterState.__init__``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvpool.master.objects import COMPLETE, ReplicaStatus
from kvpool.master.quarantine import RangeQuarantine
from kvpool.master.segments import SegmentStatus, SegmentTable
from kvpool.master.shards import Shard, ShardMap, shard_index
from kvpool.master.types import MasterStats, SegmentReport

__all__ = ["ReportsMixin"]


class ReportsMixin:
    """stats(), segments() and validate() (see the module docstring)."""

    _shards: ShardMap
    _table: SegmentTable
    _membership: threading.Lock
    _quarantine: RangeQuarantine
    _stats_lock: threading.Lock
    _hits: int
    _misses: int
    _evictions: int
    _evicted_bytes: int
    _puts: int
    _reclaimed: int

    if TYPE_CHECKING:

        def _allocatable_usage(self) -> tuple[int, int]: ...

    # =================================================================== views

    def stats(self) -> MasterStats:
        with self._stats_lock:
            hits, misses, puts, reclaimed = self._hits, self._misses, self._puts, self._reclaimed
            evictions, evicted_bytes = self._evictions, self._evicted_bytes
        segments = self.segments()
        capacity, used = self._allocatable_usage()
        processing = self._shards.count_processing()
        dram = [s for s in segments if not s.tier]
        ssd = [s for s in segments if s.tier]
        return MasterStats(
            objects=self._shards.count_objects() - processing,
            capacity=sum(s.size for s in dram),
            used=sum(s.used for s in dram),
            hits=hits,
            misses=misses,
            evictions=evictions,
            evicted_bytes=evicted_bytes,
            puts=puts,
            reclaimed_puts=reclaimed,
            segments=segments,
            processing=processing,
            stores=len(self._table.stores),
            allocatable_capacity=capacity,
            allocatable_used=used,
            ssd_capacity=sum(s.size for s in ssd),
            ssd_used=sum(s.used for s in ssd),
        )

    def segments(self) -> list[SegmentReport]:
        """Every mounted segment with its status, used bytes and replica count (admin view)."""
        out: list[SegmentReport] = []
        for seg in self._table.segments():
            st = seg.allocator.statistics()
            info = seg.info
            out.append(
                SegmentReport(
                    info.id,
                    info.node,
                    info.store_id,
                    info.size,
                    info.tcp_endpoint,
                    info.shm_path,
                    info.rdma_desc,
                    info.numa_node,
                    seg.status,
                    st.used,
                    st.allocations,
                    st.largest_free,
                    seg.tier,
                )
            )
        return out

    def validate(self) -> None:
        """Check every invariant (tests): raise AssertionError saying what is wrong.

        Allocator tiling; used bytes == sum of replica blocks per segment; every replica's segment exists;
        no two replicas share or overlap a range; one replica per segment per object; a shard holds only its
        keys; PROCESSING <-> in the shard's processing map (with its writer); counters non-negative.
        """
        with self._membership, self._shards.all_locked() as shards:
            table = self._table
            expected: dict[int, dict[int, int]] = {sid: {} for sid in table.by_id}
            for shard in shards:
                self._validate_shard(shard, expected)
            held: dict[int, set[int]] = {}
            for qseg, qoff in self._quarantine.held():
                if table.by_id.get(qseg.id) is qseg:
                    held.setdefault(qseg.id, set()).add(qoff)
            for sid, seg in table.by_id.items():
                seg.allocator.check()
                blocks = seg.allocator.allocated_ranges()
                for qoff in held.get(sid, ()):  # a revoked put's range, still held: allocated, no replica
                    if qoff in expected[sid]:
                        raise AssertionError(f"segment {sid}: offset {qoff} reused while quarantined")
                    expected[sid][qoff] = blocks.get(qoff, -1)
                if blocks != expected[sid]:
                    missing = set(blocks) - set(expected[sid])
                    extra = set(expected[sid]) - set(blocks)
                    raise AssertionError(
                        f"segment {sid}: allocator blocks != replicas (leaked offsets {sorted(missing)[:5]}, "
                        f"unallocated replica offsets {sorted(extra)[:5]}, mismatched lengths "
                        f"{[o for o in blocks if o in expected[sid] and blocks[o] != expected[sid][o]][:5]})"
                    )
                if seg.store_id not in table.stores or sid not in table.stores[seg.store_id].segment_ids:
                    raise AssertionError(f"segment {sid}: its store {seg.store_id!r} does not list it")
                if seg.removed:
                    raise AssertionError(f"segment {sid}: in the table but marked removed")
            for store_id, store in table.stores.items():
                for sid in store.segment_ids:
                    if sid not in table.by_id:
                        raise AssertionError(f"store {store_id!r} lists segment {sid} that is not mounted")
            allocatable = {
                s.id for s in table.by_id.values() if s.status == SegmentStatus.OK and not s.tier and not s.suspected
            }
            if {s.id for s in table.allocatable} != allocatable:
                raise AssertionError("allocatable segment list is stale")
        with self._stats_lock:
            counters = (
                self._hits,
                self._misses,
                self._evictions,
                self._evicted_bytes,
                self._puts,
                self._reclaimed,
            )
        if min(counters) < 0:
            raise AssertionError(f"negative counter in {counters}")
        if self._evictions > 0 and self._evicted_bytes < self._evictions:
            raise AssertionError("evicted_bytes < evictions")

    def _validate_shard(self, shard: Shard, expected: dict[int, dict[int, int]]) -> None:
        by_id = self._table.by_id
        nshards = self._shards.num_shards
        for key, meta in shard.objects.items():
            where = f"object {key!r}"
            if shard_index(key.encode(), nshards) != shard.index:
                raise AssertionError(f"{where}: in shard {shard.index}, hashes elsewhere")
            replicas = meta.replica_list()
            if meta.extra is not None and not meta.extra:
                raise AssertionError(f"{where}: empty extra-replica tuple (must be None)")
            complete = bool(meta.flags & COMPLETE)
            if complete == (key in shard.processing):
                raise AssertionError(f"{where}: COMPLETE={complete} but processing-map membership disagrees")
            if not complete and any(r.status == ReplicaStatus.COMPLETE for r in replicas):
                raise AssertionError(f"{where}: PROCESSING with a COMPLETE replica")
            if meta.size <= 0:
                raise AssertionError(f"{where}: size {meta.size}")
            seen_segments: set[int] = set()
            for sid, offset, _ in replicas:
                seg = by_id.get(sid)
                if seg is None:
                    raise AssertionError(f"{where}: replica on unknown segment {sid}")
                if sid in seen_segments:
                    raise AssertionError(f"{where}: two replicas on segment {sid}")
                seen_segments.add(sid)
                blocks = expected[sid]
                if offset in blocks:
                    raise AssertionError(f"{where}: segment {sid} offset {offset} used by two replicas")
                if offset + meta.size > seg.size:
                    raise AssertionError(f"{where}: replica beyond the end of segment {sid}")
                mask = seg.allocator.alignment - 1
                blocks[offset] = min((meta.size + mask) & ~mask, seg.size - offset)
