"""Warm standbys: a standby master follows the stores' inventories so that, once elected, it serves at once.

Decision 0070. Each store feeds every live standby its segment's inventory: the whole of it once
(:meth:`StandbyIndex.sync`, the same adoption a mount does), then the changes in the order its inventory
made them (:meth:`StandbyIndex.delta`: objects committed, objects forgotten). The standby keeps them in
an ordinary :class:`~kvpool.master.state.MasterState`, so its index is the one a leader would rebuild.

What keeps this safe although the standby's view may lag the store's by a feed period:

* a fed segment is **warm**: readable, but its status stays DRAINING (never allocatable) until the store
  has re-mounted with its real inventory (:meth:`StandbyIndex.mount`). A new leader therefore never
  hands out space a live object holds that it did not hear of;
* a warm store's heartbeat to the new leader is answered NEED_REMOUNT (:meth:`StandbyIndex.needs_remount`),
  so every store re-mounts as before; the re-mount adopts what the feed missed and drops what the store no
  longer holds, then the segment becomes allocatable;
* a stale entry read before its store re-mounted names bytes that may since have been overwritten: the
  client checks every read against the object's checksum, so that read is a miss, never wrong bytes;
* the feed is refused unless this master is a plain follower, under the same lock as the reconcile, so no
  feed news older than a re-mount is applied after it. Each index incarnation has an ``epoch``; a delta for
  another epoch (the standby restarted or was reset) is answered NEED_REMOUNT and the store syncs again.

No I/O here: the gRPC edge is in master/service.py, the store's side in store/standby_feed.py.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.common.errors import ErrorCode
from kvpool.common.log import get_logger
from kvpool.master.objects import ObjectMeta
from kvpool.master.segments import Segment, SegmentStatus
from kvpool.master.state import MasterState
from kvpool.master.types import InventoryItem, MountResult, SegmentSpec

__all__ = ["FeedResult", "StandbyIndex"]

log = get_logger(__name__)

PARKED_LIMIT = 65536
"""Most committed entries kept aside because their key was still known elsewhere (see ``_park``)."""


@dataclass(frozen=True)
class FeedResult:
    code: ErrorCode
    epoch: str = ""
    adopted: int = 0
    rejected: int = 0


class StandbyIndex:
    """The standby side of the inventory feed, over the master's current state (replaced on every reset).

    ``is_follower`` says whether this master is a plain follower now (not leading, not warming up).
    """

    def __init__(self, state: MasterState, is_follower: Callable[[], bool]) -> None:
        self._is_follower = is_follower
        self._lock = threading.Lock()
        self._state = state
        self._epoch = uuid.uuid4().hex
        self._warm: dict[int, str] = {}  # segment id -> store id: fed, not yet reconciled by a re-mount
        self._parked: OrderedDict[str, tuple[int, InventoryItem]] = OrderedDict()

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def reset(self, state: MasterState) -> None:
        """The master forgot its index (started, or deposed): a new epoch, nothing warm."""
        with self._lock:
            self._state = state
            self._epoch = uuid.uuid4().hex
            self._warm.clear()
            self._parked.clear()

    @property
    def epoch(self) -> str:
        return self._epoch

    def warm_segments(self) -> int:
        """Segments fed to this master and not yet reconciled by their store's re-mount."""
        with self._lock:
            return len(self._warm)

    # ---- the feed (standby only) ---------------------------------------------------------------------------

    def sync(self, spec: SegmentSpec, inventory: Sequence[InventoryItem]) -> FeedResult:
        """A store's whole inventory of one segment: mount it here as a warm (never allocatable) segment."""
        with self._lock:
            if not self._is_follower():
                return FeedResult(ErrorCode.NOT_LEADER)
            state = self._state
            segment = self._segment(spec.id)
            if self._warm.get(spec.id) == spec.store_id and segment is not None:
                # A re-sync: what the store no longer lists goes first, so its ranges can take what it does.
                self._drop_unheld(segment, {(item.key, item.offset) for item in inventory})
            result = state.mount_segment(spec, inventory, remount=True)
            if result.code != ErrorCode.OK:
                return FeedResult(result.code)
            state.set_segment_status([spec.id], int(SegmentStatus.DRAINING))
            self._warm[spec.id] = spec.store_id
            return FeedResult(ErrorCode.OK, self._epoch, result.adopted, result.rejected)

    def delta(
        self, store_id: str, segment_id: int, epoch: str, changes: Sequence[tuple[InventoryItem, bool]]
    ) -> FeedResult:
        """Apply a store's inventory changes, in order: ``(item, removed)`` pairs."""
        with self._lock:
            if not self._is_follower():
                return FeedResult(ErrorCode.NOT_LEADER)
            segment = self._segment(segment_id)
            if epoch != self._epoch or self._warm.get(segment_id) != store_id or segment is None:
                return FeedResult(ErrorCode.NEED_REMOUNT, self._epoch)
            state = self._state
            store = state._table.store(store_id)
            if store is not None:
                store.last_seen = state._clock.monotonic()
            adopted = rejected = 0
            for item, removed in changes:
                if removed:
                    self._forget(segment, item)
                elif self._commit(segment, item):
                    adopted += 1
                else:
                    rejected += 1
            return FeedResult(ErrorCode.OK, self._epoch, adopted, rejected)

    # ---- after the election --------------------------------------------------------------------------------

    def needs_remount(self, store_id: str) -> bool:
        """Whether a heartbeat of this store must be answered NEED_REMOUNT: it was fed, not re-mounted."""
        if not self._warm:
            return False
        # Without the lock (a reconcile holds it for seconds at 1 M objects): copying the values is one
        # step under the GIL, and a store that was just reconciled at worst re-mounts once more.
        return store_id in list(self._warm.values()) and not self._is_follower()

    def mount(self, spec: SegmentSpec, inventory: Sequence[InventoryItem], remount: bool) -> MountResult:
        """A store's (re-)mount through the master's membership RPC: for a warm segment this is the
        reconcile. What the feed left that the store no longer holds is dropped first (so the ranges are
        free for what it holds instead), then the inventory is adopted as by any mount, and only then may
        the segment allocate."""
        state = self._state
        if spec.id not in self._warm:
            return state.mount_segment(spec, inventory, remount)
        with self._lock:
            if self._warm.get(spec.id) != spec.store_id:
                return state.mount_segment(spec, inventory, remount)
            segment = self._segment(spec.id)
            dropped = 0
            if segment is not None:
                dropped = self._drop_unheld(segment, {(item.key, item.offset) for item in inventory})
            result = state.mount_segment(spec, inventory, remount)
            if result.code != ErrorCode.OK:
                return result
            del self._warm[spec.id]
            segment = self._segment(spec.id)
            if segment is not None and segment.status == SegmentStatus.DRAINING:
                state.set_segment_status([spec.id], int(SegmentStatus.OK))
            log.info("segment %d reconciled with its store: %d stale entries dropped", spec.id, dropped)
            return result

    # ---- internals -----------------------------------------------------------------------------------------

    def _segment(self, segment_id: int) -> Segment | None:
        return self._state._table.get(segment_id)

    def _commit(self, segment: Segment, item: InventoryItem) -> bool:
        state = self._state
        with state._membership:
            if state._adopt_one(segment, item, state._clock.monotonic()):
                self._parked.pop(item.key, None)
                return True
        self._park(segment.id, item)
        return False

    def _park(self, segment_id: int, item: InventoryItem) -> None:
        """Keep a refused entry whose key may be freed soon: a store commits a re-put of a key at its new
        range before the old range's free reaches it, so the feed can show the new copy first."""
        self._parked[item.key] = (segment_id, item)
        self._parked.move_to_end(item.key)
        while len(self._parked) > PARKED_LIMIT:
            self._parked.popitem(last=False)

    def _forget(self, segment: Segment, item: InventoryItem) -> None:
        parked = self._parked.get(item.key)
        if parked is not None and parked[0] == segment.id and parked[1].offset == item.offset:
            del self._parked[item.key]
            return
        if not self._unlink(segment, item.key, item.offset):
            return
        if parked is not None:  # the key's old copy is gone: its newer one may be adopted now
            held_by = self._segment(parked[0])
            if held_by is not None:
                self._commit(held_by, parked[1])

    def _unlink(self, segment: Segment, key: str, offset: int) -> bool:
        """Remove the replica of ``key`` at ``offset`` on ``segment`` and release its range (the store
        already forgot it, so no free notification is queued)."""
        state = self._state
        try:
            shard = state._shards.shard_of(key.encode())
        except (UnicodeEncodeError, AttributeError):
            return False
        with state._stripes.lock_for(key), shard.lock:
            meta = shard.objects.get(key)
            if meta is None:
                return False
            replicas = meta.replica_list()
            keep = [r for r in replicas if not (r.segment_id == segment.id and r.offset == offset)]
            if len(keep) == len(replicas):
                return False
            if keep:
                meta.set_replicas(keep)
            else:
                del shard.objects[key]
                shard.processing.pop(key, None)
        _release(segment, offset)
        return True

    def _drop_unheld(self, segment: Segment, held: set[tuple[str, int]]) -> int:
        dropped = 0
        for shard in self._state._shards:
            with shard.lock:
                stale = [
                    (key, offset)
                    for key, offset in _replicas_on(shard.objects, segment.id)
                    if (key, offset) not in held
                ]
            for key, offset in stale:
                if self._unlink(segment, key, offset):
                    dropped += 1
        return dropped


def _replicas_on(objects: dict[str, ObjectMeta], segment_id: int) -> list[tuple[str, int]]:
    """(key, offset) of every replica on ``segment_id``; the common single inline replica is checked
    without building its replica list."""
    found: list[tuple[str, int]] = []
    for key, meta in objects.items():
        if meta.extra is None:
            if meta.segment == segment_id:
                found.append((key, meta.offset))
            continue
        found.extend((key, r.offset) for r in meta.replica_list() if r.segment_id == segment_id)
    return found


def _release(segment: Segment, offset: int) -> None:
    try:
        segment.allocator.free(offset)
    except KeyError:
        log.error("segment %d: releasing unallocated offset %d", segment.id, offset)
