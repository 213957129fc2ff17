"""Membership of the master's state: segments mount (adopting the store's inventory), unmount, change status
and expire with their store; stores heartbeat and collect their free notifications; dead-store suspicion.

A mixin of ``MasterState`` (state.py), not a separate object, because membership is not separable state: it
mutates the segment table, the shard map and the tier manager that puts and reads use, under the membership
lock that ``validate`` and the standby (standby.py, which calls ``_adopt_one``) also take, and it tells the same
change listener (``on_change``, which the service sets on the MasterState after construction) about dropped
objects. The attributes it uses are declared below and assigned by ``MasterState.__init__``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

from kvpool.common.clock import Clock
from kvpool.common.errors import ErrorCode
from kvpool.common.log import get_logger
from kvpool.master.config import MasterConfig
from kvpool.master.objects import COMPLETE, MAX_OFFSET, PRIMARY_COMPLETE, ObjectMeta
from kvpool.master.segments import Segment, SegmentInfo, SegmentStatus, SegmentTable, StoreEntry
from kvpool.master.shards import ShardMap, StripedLocks
from kvpool.master.suspicion import StoreSuspicion, SuspicionReport, Verdict
from kvpool.master.tiering import TierManager
from kvpool.master.types import HeartbeatResult, InventoryItem, MountResult, SegmentSpec

__all__ = ["HEARTBEAT_FREED_LIMIT", "MembershipMixin"]

_log = get_logger(__name__)

HEARTBEAT_FREED_LIMIT = 10_000
"""Most free notifications one heartbeat reply carries."""

_U64 = 1 << 64
_by_offset = attrgetter("offset")


def _encode_key(key: object, max_bytes: int) -> bytes | ErrorCode:
    """The key's UTF-8 bytes, or INVALID_KEY (not a non-empty str, not encodable) / KEY_TOO_LONG."""
    if type(key) is not str or not key:
        return ErrorCode.INVALID_KEY
    if len(key) > max_bytes:  # every char is >= 1 byte: too long without encoding a huge string
        return ErrorCode.KEY_TOO_LONG
    try:
        encoded = key.encode()
    except UnicodeEncodeError:  # lone surrogates
        return ErrorCode.INVALID_KEY
    if len(encoded) > max_bytes:
        return ErrorCode.KEY_TOO_LONG
    return encoded


def _is_uint(value: object, limit: int = _U64) -> bool:
    return type(value) is int and 0 <= value < limit


class MembershipMixin:
    """Mount, unmount, status, heartbeat, expiry, suspicion and inventory adoption (see the module docstring)."""

    _cfg: MasterConfig
    _clock: Clock
    _shards: ShardMap
    _stripes: StripedLocks
    _table: SegmentTable
    _membership: threading.Lock
    _suspicion: StoreSuspicion
    tiers: TierManager
    on_change: Callable[[Sequence[str], Sequence[str]], None] | None

    if TYPE_CHECKING:

        def _intern_size(self, size: int) -> int: ...

    # =================================================================== membership

    def mount_segment(
        self, spec: SegmentSpec, inventory: Iterable[InventoryItem] = (), remount: bool = False
    ) -> MountResult:
        """Mount (or re-mount) a segment and adopt the store's inventory of committed objects.

        * Unknown id: the segment is added; its inventory entries become COMPLETE replicas.
        * Same id and store, same info and secret: idempotent; inventory entries the master lacks are
          adopted, the ones it has count as adopted, everything else stays as it is.
        * Same id and store but different size, endpoints or secret (the store restarted): the old segment
          is dropped with its replicas and the new one mounted from its inventory (the store is the truth).
        * Same id, another store: SEGMENT_ALREADY_EXISTS (the other store must expire or unmount first).

        An entry is adopted if its key is valid, its range is aligned and inside the segment and can be
        reserved, and an existing object of that key has the same size and checksum; otherwise it is counted
        as rejected. Garbage never raises. ``remount`` is informational (the store served before).
        """
        if not self._valid_spec(spec):
            return MountResult(ErrorCode.INVALID_ARGUMENT)
        info = SegmentInfo(
            spec.id,
            spec.node,
            spec.store_id,
            spec.size,
            spec.tcp_endpoint,
            spec.shm_path,
            bytes(spec.rdma_desc),
            spec.numa_node,
            spec.tier,
        )
        now = self._clock.monotonic()
        with self._membership:
            segment = self._table.get(spec.id)
            if segment is not None:
                if segment.store_id != spec.store_id:
                    return MountResult(ErrorCode.SEGMENT_ALREADY_EXISTS)
                if segment.info != info or segment.secret != spec.secret:
                    _log.info("segment %d re-mounted with a new spec: replacing it", spec.id)
                    self._drop_segments([segment])
                    segment = None
            store = self._table.ensure_store(spec.store_id, now, self._seq_base())
            store.last_seen = now
            if segment is None:
                segment = self._table.add(info, bytes(spec.secret), store)
                if segment.tier:
                    self.tiers.attach(segment)
            if self._suspicion.is_suspected(spec.store_id) and self._suspicion.heartbeat(spec.store_id, now):
                self._mark_suspected(store, False)
            adopted, rejected = self._adopt(segment, inventory, now)
            # Allocatable only now: a put racing the adoption must not take a range the inventory claims.
            self._table.publish()
            self.tiers.refresh()
        if rejected:
            _log.warning("segment %d: adopted %d inventory entries, rejected %d", spec.id, adopted, rejected)
        return MountResult(ErrorCode.OK, adopted, rejected)

    def unmount_segment(self, segment_id: int, store_id: str = "") -> tuple[ErrorCode, int]:
        """Drop a segment and all its replicas at once; objects left with no replica vanish.

        Returns (code, objects that vanished). ``store_id`` must own the segment; "" = any (admin).
        Unknown segment (or another store's) -> SEGMENT_NOT_FOUND.
        """
        with self._membership:
            segment = self._table.get(segment_id)
            if segment is None or (store_id and segment.store_id != store_id):
                return ErrorCode.SEGMENT_NOT_FOUND, 0
            dropped = self._drop_segments([segment])
        return ErrorCode.OK, dropped

    def set_segment_status(self, segment_ids: Sequence[int], status: int) -> list[ErrorCode]:
        """Set OK / DRAINING (readable, no new allocations) / DRAINED (not readable) per segment."""
        try:
            new_status = SegmentStatus(status)
        except ValueError:
            return [ErrorCode.INVALID_ARGUMENT for _ in segment_ids]
        codes: list[ErrorCode] = []
        with self._membership:
            for segment_id in segment_ids:
                segment = self._table.get(segment_id)
                if segment is None:
                    codes.append(ErrorCode.SEGMENT_NOT_FOUND)
                else:
                    segment.set_status(new_status)
                    codes.append(ErrorCode.OK)
            self._table.publish()
        return codes

    def heartbeat(self, store_id: str, segment_ids: Sequence[int], freed_ack: int = 0) -> HeartbeatResult:
        """Refresh a store's liveness and hand it the ranges freed since ``freed_ack``.

        Unknown store, or a listed segment the master does not have for it -> NEED_REMOUNT (the store then
        mounts all its segments again with its inventory).
        """
        store = self._table.store(store_id)
        if store is None:
            return HeartbeatResult(ErrorCode.NEED_REMOUNT)
        by_id = self._table.by_id
        for segment_id in segment_ids:
            segment = by_id.get(segment_id)
            if segment is None or segment.store_id != store_id:
                return HeartbeatResult(ErrorCode.NEED_REMOUNT)
        store.last_seen = self._clock.monotonic()
        if self._suspicion.is_suspected(store_id):
            self._heard_from(store_id, store.last_seen)
        return HeartbeatResult(ErrorCode.OK, store.take(freed_ack, HEARTBEAT_FREED_LIMIT))

    def expire_stores(self) -> list[str]:
        """Remove the stores silent for longer than ``store_ttl_s``, with their segments and replicas."""
        now = self._clock.monotonic()
        ttl = self._cfg.store_ttl_s
        expired: list[str] = []
        with self._membership:
            for store_id, store in list(self._table.stores.items()):
                if now - store.last_seen <= ttl:
                    continue
                self._table.remove_store(store_id)
                self._suspicion.forget(store_id)
                segments = [s for s in (self._table.get(i) for i in list(store.segment_ids)) if s is not None]
                dropped = self._drop_segments(segments)
                expired.append(store_id)
                _log.warning("store %s expired: %d segments and %d objects dropped", store_id, len(segments), dropped)
        return expired

    # =================================================================== dead-store suspicion

    def report_store_failures(self, client_id: str, tcp_endpoints: Sequence[str]) -> SuspicionReport:
        """A client could not connect to these data-plane endpoints (master/suspicion.py has the rules).

        Returns the reported endpoints whose store is suspected now, and those the caller must probe
        (then ``store_probe_result``). Endpoints no mounted segment has are ignored.
        """
        now = self._clock.monotonic()
        suspected: list[str] = []
        probe: list[str] = []
        with self._membership:
            for endpoint in dict.fromkeys(tcp_endpoints):
                store = self._store_at(endpoint)
                if store is None:
                    continue
                verdict = self._suspicion.report(store.store_id, client_id, now)
                if verdict == Verdict.SUSPECTED:
                    self._mark_suspected(store, True)
                    suspected.append(endpoint)
                elif verdict == Verdict.PROBE:
                    probe.append(endpoint)
        return SuspicionReport(suspected, probe)

    def store_probe_result(self, tcp_endpoint: str, reachable: bool) -> bool:
        """The outcome of the service's probe of a data plane; True when it made its store suspected."""
        now = self._clock.monotonic()
        with self._membership:
            store = self._store_at(tcp_endpoint)
            if store is None or not self._suspicion.probe_result(store.store_id, reachable, now):
                return False
            self._mark_suspected(store, True)
        _log.warning("store %s (%s) suspected dead: the master's probe failed", store.store_id, tcp_endpoint)
        return True

    def suspected_stores(self) -> list[str]:
        with self._membership:
            return sorted(self._suspicion.suspected)

    def _heard_from(self, store_id: str, now: float) -> None:
        with self._membership:
            store = self._table.store(store_id)
            if store is not None and self._suspicion.heartbeat(store_id, now):
                self._mark_suspected(store, False)
                _log.info("store %s heartbeats again: no longer suspected", store_id)

    def _store_at(self, tcp_endpoint: str) -> StoreEntry | None:
        for segment in self._table.by_id.values():
            if segment.tcp_endpoint == tcp_endpoint:
                return segment.store
        return None

    def _mark_suspected(self, store: StoreEntry, suspected: bool) -> None:
        """Flag (or unflag) every segment of ``store``: a suspected one is neither readable nor allocatable."""
        for segment_id in store.segment_ids:
            segment = self._table.get(segment_id)
            if segment is not None and segment.suspected != suspected:
                segment.suspected = suspected
                segment.set_status(segment.status)
        self._table.publish()

    # =================================================================== internals: membership

    def _seq_base(self) -> int:
        # Free-notification sequence numbers start from the wall clock in microseconds, so a new leader's
        # numbers are above what a store acknowledged to the previous one (stores should also reset their
        # ack when they re-mount).
        return self._clock.wall_ms() * 1000

    def _valid_spec(self, spec: SegmentSpec) -> bool:
        try:
            return (
                _is_uint(spec.id)
                and isinstance(spec.store_id, str)
                and bool(spec.store_id)
                and isinstance(spec.node, str)
                and type(spec.size) is int
                and 0 < spec.size <= MAX_OFFSET + 1
                and isinstance(spec.secret, bytes | bytearray)
                and len(spec.secret) > 0
                and isinstance(spec.tcp_endpoint, str)
                and isinstance(spec.shm_path, str)
                and isinstance(spec.rdma_desc, bytes | bytearray)
                and type(spec.numa_node) is int
                and spec.tier in (0, 1)
                and type(spec.tier) is int
            )
        except AttributeError:
            return False

    def _drop_segments(self, segments: Sequence[Segment]) -> int:
        """Remove segments from the table and strip their replicas from every object (membership lock held).
        Returns how many objects vanished. Their ranges are not freed: the allocators go with the segments."""
        ids = set()
        for seg in segments:
            self._table.remove(seg.id)
            ids.add(seg.id)
        self._table.publish()
        self.tiers.refresh()
        if not ids:
            return 0
        dropped = 0
        for shard in self._shards:
            with shard.lock:
                objects = shard.objects
                doomed: list[str] = []
                for key, meta in objects.items():
                    if meta.extra is None:
                        if meta.segment in ids:
                            doomed.append(key)
                        continue
                    replicas = meta.replica_list()
                    keep = [r for r in replicas if r.segment_id not in ids]
                    if not keep:
                        doomed.append(key)
                    elif len(keep) != len(replicas):
                        meta.set_replicas(keep)
                for key in doomed:
                    del objects[key]
                    shard.processing.pop(key, None)
                dropped += len(doomed)
            if doomed and self.on_change is not None:
                self.on_change((), doomed)
        return dropped

    def _adopt(self, segment: Segment, inventory: Iterable[InventoryItem], now: float) -> tuple[int, int]:
        """Adopt a store's inventory into ``segment`` (membership lock held): (adopted, rejected)."""
        items: list[InventoryItem] = []
        rejected = 0
        try:
            entries = list(inventory)
        except TypeError:
            return 0, 0
        for item in entries:
            if isinstance(item, InventoryItem) and type(item.offset) is int:
                items.append(item)
            else:
                rejected += 1
        # Offset order makes each reserve split the tail extent: O(1) each instead of O(extents).
        items.sort(key=_by_offset)
        adopted = 0
        for item in items:
            if self._adopt_one(segment, item, now):
                adopted += 1
            else:
                rejected += 1
        return adopted, rejected

    def _adopt_one(self, segment: Segment, item: InventoryItem, now: float) -> bool:
        cfg = self._cfg
        kb = _encode_key(item.key, cfg.max_key_bytes)
        offset, length, checksum = item.offset, item.length, item.checksum
        if (
            not isinstance(kb, bytes)
            or item.tier != segment.tier
            or not _is_uint(offset)
            or not _is_uint(checksum)
            or type(length) is not int
            or not 0 < length <= cfg.max_object_bytes
            or offset + length > segment.size
        ):
            return False
        key = item.key
        shard = self._shards.shard_of(kb)
        with self._stripes.lock_for(key), shard.lock:
            meta = shard.objects.get(key)
            if meta is None:
                if not segment.allocator.reserve(offset, length):
                    return False
                shard.objects[key] = ObjectMeta(
                    self._intern_size(length), segment.id, offset, now, COMPLETE | PRIMARY_COMPLETE, checksum
                )
                return True
            if not meta.flags & COMPLETE or meta.size != length or meta.checksum != checksum:
                return False
            for r in meta.replica_list():
                if r.segment_id == segment.id:
                    # Already known (an idempotent re-mount) or a second copy on one segment (refused).
                    return r.offset == offset and r.complete
            if not segment.allocator.reserve(offset, length):
                return False
            meta.add_replica(segment.id, offset, True)
            return True
