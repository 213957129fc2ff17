"""The SSD tier in the master: demote on eviction, promote on repeated reads, evict the SSD by its own LRU.

A store with an SSD tier mounts it as a second segment with ``tier=1`` (no shared memory, never allocatable
for puts). Its allocator does the bookkeeping of the SSD bytes, so SSD replicas are ordinary replicas of the
object index: ``(ssd segment, offset)``, with the usual PROCESSING/COMPLETE status. What this module adds:

* **Demotion.** When eviction picks an object whose DRAM replica sits on a store with an SSD tier that has
  room, the DRAM range is not freed at once: an SSD range is allocated, the object gets a PROCESSING SSD
  replica (so it stays readable from DRAM and is neither evictable nor removable meanwhile), and a DEMOTE
  task is queued for the store. The store copies the bytes locally and reports the result; then the SSD
  replica becomes COMPLETE and the DRAM replicas are freed (the usual free notifications follow). If the
  object was read or leased meanwhile it is hot again: it keeps both copies. An object that already has an
  SSD copy is "demoted" by freeing its DRAM replicas only (the SSD tier is inclusive).
* **Backpressure, not drops** (Mooncake issue #2187: with offload-on-evict, DRAM stayed full and every put
  failed). Demotion is what the *background* eviction does; it frees DRAM only when the store has copied,
  so the DRAM waiting for demotion is counted as already freed by the watermark check and capped at
  ``demote_max_pending`` of the pool; a victim past the cap stays in DRAM until the backlog drains (it is
  not dropped). A put that finds DRAM full while demotions are in flight is refused with
  ``DEMOTION_BACKLOG`` (the client retries until its deadline) instead of dropping objects the SSD could
  hold. Only when no demotion can help (no SSD tier on that store, the SSD full, its disk failing) does an
  eviction forced by a failed allocation (``urgent``) drop objects as before; drops are counted.
  That is the default burst policy; ``drop-coldest`` (master/burst.py) never refuses the put and lets the
  urgent eviction drop the coldest objects at once, counted as ``burst_dropped``.
* **Promotion.** Reads (``get_replicas`` with a lease) of an object that lives only on SSD are counted;
  after ``promote_after_hits`` reads a DRAM range is allocated on the same store and a PROMOTE task makes
  the store copy SSD -> DRAM; the DRAM replica becomes COMPLETE when the store reports it. The SSD copy
  stays, so the next eviction of that object costs no write.
* **SSD eviction.** Above ``ssd_high_watermark`` of a store's SSD tier, the least recently used SSD replicas
  are dropped down to ``ssd_eviction_target`` (the object survives if it still has a DRAM copy).
* **Order of SSD writes and deletes.** Every SSD range the master frees becomes a DELETE task in the same
  per-store FIFO as the DEMOTE tasks, queued under the channel lock together with the allocator's free, and
  every DEMOTE is queued under that lock together with its allocation. So the store always deletes the old
  file of a range before it writes the next object into that range, and never deletes a newer object.

Tasks not reported within ``tier_task_timeout_s`` are abandoned (the PROCESSING replica is dropped and its
range freed). The store polls ``TierTasks`` quickly while it has work (master/service.py, store/tiering.py).

Lock order (extends shards.py): object stripe -> shard lock -> tier channel lock -> SSD allocator lock. The
manager's counter lock is a leaf. Nothing here takes a second stripe while holding one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

from kvpool.common.clock import Clock
from kvpool.common.errors import ErrorCode
from kvpool.common.log import get_logger
from kvpool.master.allocator import OffsetAllocator
from kvpool.master.burst import make_burst_policy
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import Candidate
from kvpool.master.objects import COMPLETE, HARD_PIN, ObjectMeta, Replica, ReplicaStatus
from kvpool.master.segments import Segment, SegmentStatus, SegmentTable
from kvpool.master.shards import Shard, ShardMap, StripedLocks
from kvpool.master.task_queue import TaskQueue

__all__ = [
    "TIER_DRAM",
    "TIER_SSD",
    "TaskKind",
    "TierAllocator",
    "TierChannel",
    "TierManager",
    "TierTask",
]

_log = get_logger(__name__)

TIER_DRAM = 0
TIER_SSD = 1

HIT_TABLE_LIMIT = 1 << 16
"""Most SSD-only objects whose reads are being counted for promotion (oldest forgotten first)."""

Range = tuple[Segment, int]
FreeRanges = Callable[[list[Range], str], None]
"""Frees one object's ranges; the key names it in the store's free notification."""
HoldRanges = Callable[[float, list[Range], str], None]
"""(release time, ranges): keep ranges allocated until then (MasterState's quarantine)."""

TAKE_MAX_BYTES = 8 << 20
"""Most bytes of copies handed to a store in one exchange. Smaller than the demotion backlog's cap, so the
master queues the next batch while the store writes this one (the store pulls again at once while tasks
are pending): the disk never waits for a round trip."""

RATE_WINDOW_SAMPLES = 6
"""The SSD write/read rates in the stats are over the last this-many seconds (one sample a second)."""

ABANDON_GRACE_S = 5.0
"""After a task is abandoned, how long a range the store could still have been writing stays allocated."""

_COMPLETE = ReplicaStatus.COMPLETE
_EVICTABLE_MASK = COMPLETE | HARD_PIN


class _Demote(IntEnum):
    STARTED = 0
    DEFERRED = 1
    IMPOSSIBLE = 2


class TaskKind(IntEnum):
    """Values of ``kvpool.v1.TierTaskKind``."""

    DEMOTE = 1
    PROMOTE = 2
    DELETE = 3


@dataclass(slots=True)
class TierTask:
    """One store-local copy (or delete) the master asks a store to do."""

    id: int
    kind: TaskKind
    key: str
    src_segment: int
    src_offset: int
    dst_segment: int
    dst_offset: int
    length: int
    checksum: int
    created: float = 0.0
    deadline_ms: int = 0
    """Wall clock: the store does not start a DEMOTE/PROMOTE after this. Half the task timeout, so that a
    task the master abandons can no longer be started by the store."""
    last_access: float = 0.0
    """DEMOTE: the object's last access when it was picked; a later touch keeps its DRAM copy."""
    pending_bytes: int = 0
    """DEMOTE: the DRAM bytes it will free, counted as freed by the watermark until it is done."""


class TierChannel:
    """One store's tier tasks: a :class:`TaskQueue` (master/task_queue.py, the pipeline moves use too) under
    the channel lock, which also covers the SSD allocator (see the module docstring)."""

    def __init__(self, store_id: str) -> None:
        self.store_id = store_id
        self.lock = threading.Lock()
        self.tasks: TaskQueue[TierTask] = TaskQueue(_task_id)
        self._next_id = 1
        self.backoff_until = 0.0
        """No new demotions to this store before this time (after repeated failures)."""
        self.failures = 0

    @property
    def queue(self) -> deque[TierTask]:
        return self.tasks.queue

    @property
    def inflight(self) -> dict[int, TierTask]:
        return self.tasks.inflight

    def push_locked(
        self,
        kind: TaskKind,
        key: str,
        src: tuple[int, int],
        dst: tuple[int, int],
        length: int,
        checksum: int,
        now: float,
    ) -> TierTask:
        """Queue a task (caller holds ``lock``)."""
        task = TierTask(self._next_id, kind, key, src[0], src[1], dst[0], dst[1], length, checksum, now)
        self._next_id += 1
        self.tasks.push(task)
        return task

    def take(self, limit: int, max_bytes: int = TAKE_MAX_BYTES) -> tuple[list[TierTask], int]:
        """Up to ``limit`` tasks in queue order, copying at most ``max_bytes`` (at least one task); DEMOTE and
        PROMOTE become in flight (a DELETE needs no report). Also returns how many remain."""
        with self.lock:
            out = self.tasks.take(limit, cost=_copy_bytes, budget=max_bytes, tracked=_reported)
            return out, self.tasks.queued()

    def finish(self, task_id: int) -> TierTask | None:
        with self.lock:
            return self.tasks.finish(task_id)

    def expired(self, horizon: float) -> list[TierTask]:
        """Remove and return the DEMOTE/PROMOTE tasks created before ``horizon`` (queued or in flight)."""
        with self.lock:
            return self.tasks.remove_where(lambda t: t.kind != TaskKind.DELETE and t.created < horizon)

    def drain_all(self) -> list[TierTask]:
        """Every DEMOTE/PROMOTE task still open (the store is gone)."""
        with self.lock:
            return [t for t in self.tasks.drain() if t.kind != TaskKind.DELETE]

    def pending(self) -> int:
        return len(self.tasks)


def _task_id(task: TierTask) -> int:
    return task.id


def _reported(task: TierTask) -> bool:
    return task.kind != TaskKind.DELETE


def _copy_bytes(task: TierTask) -> int:
    return 0 if task.kind == TaskKind.DELETE else task.length


class TierAllocator(OffsetAllocator):
    """The allocator of an SSD-tier segment: each free also queues a DELETE for the store, atomically with
    the free (under the channel lock), so the DELETE precedes any later DEMOTE into the same range."""

    def __init__(self, size: int, alignment: int, segment_id: int, channel: TierChannel, clock: Clock) -> None:
        super().__init__(size, alignment)
        self._segment_id = segment_id
        self._channel = channel
        self._clock = clock

    def free(self, offset: int) -> int:
        channel = self._channel
        with channel.lock:
            length = super().free(offset)
            channel.push_locked(
                TaskKind.DELETE, "", (0, 0), (self._segment_id, offset), length, 0, self._clock.monotonic()
            )
        return length


@dataclass
class _Counters:
    demotions: int = 0
    demoted_bytes: int = 0
    demote_failures: int = 0
    promotions: int = 0
    promote_failures: int = 0
    dram_dropped: int = 0
    """Objects evicted from DRAM with no SSD copy although the pool has an SSD tier (urgent, cap, no room)."""
    dram_dropped_urgent: int = 0
    """... of which by an eviction forced by a failed allocation (demotion did not keep up)."""
    burst_dropped: int = 0
    """... of which while demotions were in flight: the drop-coldest burst policy's drops (master/burst.py)."""
    burst_dropped_bytes: int = 0
    ssd_evictions: int = 0
    ssd_evicted_bytes: int = 0
    tasks_expired: int = 0
    pending_bytes: int = 0
    puts_backpressured: int = 0
    """Put keys refused with DEMOTION_BACKLOG (the client retries them)."""
    ssd_read_granted_bytes: int = 0
    """Bytes of leased reads the master sent to SSD-only replicas (re-reads under a cached lease skip it)."""


class TierManager:
    """The SSD-tier mechanism of one MasterState (see the module docstring). Pure: no I/O, no threads."""

    def __init__(
        self,
        config: MasterConfig,
        clock: Clock,
        shards: ShardMap,
        stripes: StripedLocks,
        table: SegmentTable,
        free_ranges: FreeRanges,
        hold_ranges: HoldRanges | None = None,
    ) -> None:
        self._cfg = config
        self._clock = clock
        self._shards = shards
        self._stripes = stripes
        self._table = table
        self._free_ranges = free_ranges
        self._hold_ranges = hold_ranges
        self.burst_policy = make_burst_policy(config.ssd_burst_policy)
        self._lock = threading.Lock()
        self._channels: dict[str, TierChannel] = {}
        self._hits: OrderedDict[str, int] = OrderedDict()
        self._c = _Counters()
        self._next_expiry_check = 0.0
        self._io_samples: deque[tuple[float, int, int]] = deque(maxlen=RATE_WINDOW_SAMPLES)
        """(time, demoted bytes, SSD read bytes granted), one a second: the SSD write and read rates."""
        self.progress = threading.Event()
        """Set when demotions finish or a put waits for them: the eviction thread runs at once (it queues
        the next demotions while DRAM is above its watermark) instead of at its next interval."""
        self.ssd_ids: frozenset[int] = frozenset()
        """Ids of the mounted SSD-tier segments (empty: no tier anywhere, every hook is a no-op)."""

    # ------------------------------------------------------------------ membership hooks

    @property
    def active(self) -> bool:
        return bool(self.ssd_ids)

    @property
    def pending_bytes(self) -> int:
        """DRAM bytes whose demotion is queued or running (the watermark counts them as free)."""
        return self._c.pending_bytes

    def attach(self, segment: Segment) -> None:
        """A new SSD-tier segment (before its inventory is adopted): give it the task-queuing allocator."""
        segment.allocator = TierAllocator(
            segment.size,
            segment.allocator.alignment,
            segment.id,
            self._channel(segment.store_id),
            self._clock,
        )

    def refresh(self) -> None:
        """Recompute the SSD segment ids after a mount or a drop (membership lock held)."""
        self.ssd_ids = frozenset(s.id for s in self._table.by_id.values() if s.tier)

    def _channel(self, store_id: str) -> TierChannel:
        with self._lock:
            channel = self._channels.get(store_id)
            if channel is None:
                channel = self._channels[store_id] = TierChannel(store_id)
            return channel

    def dram_count(self, meta: ObjectMeta) -> int:
        """Replicas of ``meta`` in DRAM (what a DRAM eviction of it frees, in replicas)."""
        ssd = self.ssd_ids
        n = 0 if meta.segment in ssd else 1
        if meta.extra is not None:
            for r in meta.replica_list()[1:]:
                if r.segment_id not in ssd:
                    n += 1
        return n

    # ------------------------------------------------------------------ eviction (DRAM)

    def evict_one(self, cand: Candidate, now: float, urgent: bool) -> tuple[int, bool]:
        """Evict one DRAM victim: (DRAM bytes freed or being demoted, whether the object is gone)."""
        key = cand.key
        shard = self._shards.shard_of(key.encode())
        ranges: list[Range] = []
        with self._stripes.lock_for(key):
            with shard.lock:
                meta = shard.objects.get(key)
                if meta is None or not _still_victim(meta, cand, now):
                    return 0, False
                replicas = meta.replica_list()
                ssd = [r for r in replicas if r.segment_id in self.ssd_ids]
                dram = [r for r in replicas if r.segment_id not in self.ssd_ids]
                if not dram:
                    return 0, False
                freed = meta.size * len(dram)
                if ssd:  # already on SSD (all replicas are complete): free the DRAM copies only
                    meta.set_replicas(ssd)
                    ranges = self._resolve(dram)
                    gone = False
                elif not urgent and (started := self._start_demote(key, meta, dram, now)) != _Demote.IMPOSSIBLE:
                    # DEFERRED: the backlog is full; the object stays in DRAM until demotions catch up
                    # (the put path applies backpressure meanwhile) instead of being dropped.
                    return (freed if started == _Demote.STARTED else 0), False
                else:
                    del shard.objects[key]
                    shard.processing.pop(key, None)
                    ranges = self._resolve(replicas)
                    gone = True
            self._free_ranges(ranges, key)
        if gone:
            with self._lock:
                self._c.dram_dropped += 1
                if urgent:
                    self._c.dram_dropped_urgent += 1
                    if self._c.pending_bytes > 0:  # the burst policy chose to drop rather than wait
                        self._c.burst_dropped += 1
                        self._c.burst_dropped_bytes += freed
        return freed, gone

    def _start_demote(self, key: str, meta: ObjectMeta, dram: list[Replica], now: float) -> _Demote:
        """Queue a DEMOTE of ``meta`` (stripe and shard lock held): STARTED; DEFERRED when the backlog is
        full or the store's demotions are paused; IMPOSSIBLE when its store has no SSD tier with room."""
        pending = meta.size * len(dram)
        src = dram[0]
        dram_seg = self._table.by_id.get(src.segment_id)
        if dram_seg is None:
            return _Demote.IMPOSSIBLE
        ssd_seg = self._tier_segment(dram_seg.store_id, TIER_SSD)
        channel = self._channels.get(dram_seg.store_id)
        if ssd_seg is None or channel is None:
            return _Demote.IMPOSSIBLE
        if channel.backoff_until > now:
            return _Demote.IMPOSSIBLE  # its disk keeps failing: behave as a pool without an SSD tier
        if self._c.pending_bytes + pending > self._max_pending():
            return _Demote.DEFERRED
        with channel.lock:
            offset = ssd_seg.allocator.allocate(meta.size)
            if offset is None:
                return _Demote.IMPOSSIBLE  # SSD full: the SSD eviction (maintain) makes room for later ones
            task = channel.push_locked(
                TaskKind.DEMOTE,
                key,
                (src.segment_id, src.offset),
                (ssd_seg.id, offset),
                meta.size,
                meta.checksum,
                now,
            )
            task.deadline_ms = self._deadline_ms()
            task.last_access = meta.last_access
            task.pending_bytes = pending
        meta.add_replica(ssd_seg.id, offset, False)
        with self._lock:
            self._c.pending_bytes += pending
        return _Demote.STARTED

    def _max_pending(self) -> float:
        return self._cfg.demote_max_pending * sum(s.size for s in self._table.allocatable)

    def saturated(self) -> bool:
        """The demotion backlog is at its cap: a non-urgent eviction can start no more demotions now."""
        return self._c.pending_bytes >= self._max_pending()

    def backpressure(self, keys: int) -> bool:
        """A put found DRAM full: True (count ``keys`` refused with DEMOTION_BACKLOG) when demotions in
        flight will free DRAM soon and the burst policy holds puts back; False when nothing will free DRAM
        or the policy is drop-coldest (the caller drops the coldest objects by an urgent eviction)."""
        if self._c.pending_bytes <= 0 or not self.burst_policy.holds_back:
            return False
        with self._lock:
            self._c.puts_backpressured += keys
        self.progress.set()
        return True

    def _tier_segment(self, store_id: str, tier: int) -> Segment | None:
        """The store's segment of ``tier`` that is mounted and OK (the first one)."""
        store = self._table.stores.get(store_id)
        if store is None:
            return None
        by_id = self._table.by_id
        for sid in store.segment_ids:
            seg = by_id.get(sid)
            if seg is not None and seg.tier == tier and seg.status == SegmentStatus.OK and not seg.removed:
                return seg
        return None

    def _resolve(self, replicas: Iterable[Replica]) -> list[Range]:
        by_id = self._table.by_id
        out: list[Range] = []
        for r in replicas:
            seg = by_id.get(r.segment_id)
            if seg is not None:
                out.append((seg, r.offset))
        return out

    # ------------------------------------------------------------------ promotion

    def note_hits(self, keys: Sequence[str], nbytes: int = 0) -> int:
        """Reads of SSD-only objects (``nbytes`` in all); promotes those read ``promote_after_hits`` times.
        Returns promotions started."""
        if nbytes:
            with self._lock:
                self._c.ssd_read_granted_bytes += nbytes
        threshold = self._cfg.promote_after_hits
        if threshold <= 0:
            return 0
        ready: list[str] = []
        with self._lock:
            hits = self._hits
            for key in keys:
                n = hits.pop(key, 0) + 1
                if n >= threshold:
                    ready.append(key)
                else:
                    hits[key] = n
            while len(hits) > HIT_TABLE_LIMIT:
                hits.popitem(last=False)
        now = self._clock.monotonic()
        return sum(1 for key in ready if self._start_promote(key, now))

    def _start_promote(self, key: str, now: float) -> bool:
        shard = self._shards.shard_of(key.encode())
        with self._stripes.lock_for(key), shard.lock:
            meta = shard.objects.get(key)
            if meta is None or not meta.flags & COMPLETE or not meta.all_replicas_complete():
                return False
            replicas = meta.replica_list()
            if any(r.segment_id not in self.ssd_ids for r in replicas):
                return False  # it has a DRAM copy already
            src = replicas[0]
            ssd_seg = self._table.by_id.get(src.segment_id)
            if ssd_seg is None:
                return False
            dram_seg = self._tier_segment(ssd_seg.store_id, TIER_DRAM)
            channel = self._channels.get(ssd_seg.store_id)
            if dram_seg is None or channel is None:
                return False
            offset = dram_seg.allocate_for(key, meta.size)  # decision 0082
            if offset is None:
                return False  # DRAM full: stay on SSD (the next reads will try again)
            meta.add_replica(dram_seg.id, offset, False)
            with channel.lock:
                task = channel.push_locked(
                    TaskKind.PROMOTE,
                    key,
                    (src.segment_id, src.offset),
                    (dram_seg.id, offset),
                    meta.size,
                    meta.checksum,
                    now,
                )
                task.deadline_ms = self._deadline_ms()
        return True

    def _deadline_ms(self) -> int:
        return self._clock.wall_ms() + int(self._cfg.tier_task_timeout_s * 500)

    # ------------------------------------------------------------------ the store's side of the channel

    def exchange(
        self, store_id: str, done: Sequence[tuple[int, int]], max_tasks: int
    ) -> tuple[ErrorCode, list[TierTask], int]:
        """A store reports finished tasks ``(id, code)`` and takes up to ``max_tasks`` new ones.

        Returns (NEED_REMOUNT for an unknown store, else OK; tasks; tasks still queued)."""
        if store_id not in self._table.stores:
            return ErrorCode.NEED_REMOUNT, [], 0
        with self._lock:
            channel = self._channels.get(store_id)
        if channel is None:
            return ErrorCode.OK, [], 0
        for task_id, code in done:
            task = channel.finish(task_id)
            if task is not None:
                self._finish(channel, task, _code(code))
        if done:
            self.progress.set()
        tasks, pending = channel.take(max(0, max_tasks))
        return ErrorCode.OK, tasks, pending

    def _finish(self, channel: TierChannel, task: TierTask, code: ErrorCode) -> None:
        if task.kind == TaskKind.DEMOTE:
            ok = self._finish_demote(task, code)
            with self._lock:
                self._c.pending_bytes -= task.pending_bytes
                if ok:
                    self._c.demotions += 1
                    self._c.demoted_bytes += task.length
                else:
                    self._c.demote_failures += 1
            # Repeated failures (a full or broken disk): stop demoting to this store for a while.
            channel.failures = 0 if ok else channel.failures + 1
            if channel.failures >= 8:
                channel.backoff_until = self._clock.monotonic() + 5.0
                channel.failures = 0
                _log.warning("store %s: demotions keep failing (%s): pausing them for 5 s", channel.store_id, code.name)
        elif task.kind == TaskKind.PROMOTE:
            ok = self._finish_promote(task, code)
            with self._lock:
                if ok:
                    self._c.promotions += 1
                else:
                    self._c.promote_failures += 1

    def _finish_demote(self, task: TierTask, code: ErrorCode) -> bool:
        """Apply a DEMOTE result; True if the object now has its SSD copy."""
        key = task.key
        shard = self._shards.shard_of(key.encode())
        ranges: list[Range] = []
        ok = False
        with self._stripes.lock_for(key):
            with shard.lock:
                meta = shard.objects.get(key)
                replicas = meta.replica_list() if meta is not None else []
                target = _find(replicas, task.dst_segment, task.dst_offset)
                if meta is None or target is None:
                    return False  # the SSD segment went away with its replicas (and its allocator)
                rest = [r for r in replicas if r is not target]
                if code == ErrorCode.OK:
                    ok = True
                    done = Replica(target.segment_id, target.offset, _COMPLETE)
                    now = self._clock.monotonic()
                    hot = meta.lease_until > now or meta.last_access != task.last_access
                    if hot:  # read or touched since it was picked: keep the DRAM copy as well
                        meta.set_replicas([*rest, done])
                    else:
                        dram = [r for r in rest if r.segment_id not in self.ssd_ids]
                        meta.set_replicas([r for r in rest if r.segment_id in self.ssd_ids] + [done])
                        ranges = self._resolve(dram)
                elif rest and code != ErrorCode.CHECKSUM_MISMATCH:
                    meta.set_replicas(rest)
                    ranges = self._resolve([target])
                else:
                    # The DRAM copy is gone (its segment dropped) or corrupt: the object is lost.
                    if code == ErrorCode.CHECKSUM_MISMATCH:
                        _log.error("demotion of %r: DRAM bytes do not match the checksum; dropping it", key)
                    del shard.objects[key]
                    ranges = self._resolve(replicas)
            self._free_ranges(ranges, key)
        return ok

    def _finish_promote(self, task: TierTask, code: ErrorCode) -> bool:
        key = task.key
        shard = self._shards.shard_of(key.encode())
        ranges: list[Range] = []
        with self._stripes.lock_for(key):
            with shard.lock:
                meta = shard.objects.get(key)
                replicas = meta.replica_list() if meta is not None else []
                target = _find(replicas, task.dst_segment, task.dst_offset)
                if meta is None or target is None:
                    return False
                rest = [r for r in replicas if r is not target]
                if code == ErrorCode.OK:
                    meta.set_replicas([Replica(target.segment_id, target.offset, _COMPLETE), *rest])
                    return True
                if rest:
                    meta.set_replicas(rest)
                else:
                    del shard.objects[key]
                ranges = self._resolve([target])
            if code == ErrorCode.TIMEOUT and self._hold_ranges is not None:
                # Abandoned without a word from the store: it cannot start the copy any more (the task's
                # deadline has passed), but one it started just before may still be writing the range.
                self._hold_ranges(self._clock.monotonic() + ABANDON_GRACE_S, ranges, key)
            else:
                self._free_ranges(ranges, key)
        return False

    # ------------------------------------------------------------------ periodic

    def maintain(self) -> int:
        """Expire overdue tasks, forget channels of departed stores, and evict SSD tiers above their
        watermark. Returns SSD replicas dropped."""
        now = self._clock.monotonic()
        if now >= self._next_expiry_check:  # once a second is plenty for a 30 s timeout
            self._next_expiry_check = now + 1.0
            self._expire_tasks(now)
            with self._lock:
                self._io_samples.append((now, self._c.demoted_bytes, self._c.ssd_read_granted_bytes))
        dropped = 0
        cfg = self._cfg
        for seg in [s for s in self._table.segments() if s.tier]:
            used = seg.allocator.used
            if used > cfg.ssd_high_watermark * seg.size:
                dropped += self.evict_ssd(seg, used - int(cfg.ssd_eviction_target * seg.size))
        return dropped

    def _expire_tasks(self, now: float) -> None:
        horizon = now - self._cfg.tier_task_timeout_s
        with self._lock:
            channels = list(self._channels.items())
        for store_id, channel in channels:
            if store_id not in self._table.stores:
                overdue = channel.drain_all()
                with self._lock:
                    # Re-checked under the lock: the store may have mounted again meanwhile.
                    if store_id not in self._table.stores and self._channels.get(store_id) is channel:
                        del self._channels[store_id]
            else:
                overdue = channel.expired(horizon)
            for task in overdue:
                _log.warning("tier task %s of %r on store %s abandoned", task.kind.name, task.key, store_id)
                self._finish(channel, task, ErrorCode.TIMEOUT)
                with self._lock:
                    self._c.tasks_expired += 1

    def evict_ssd(self, seg: Segment, bytes_to_free: int) -> int:
        """Drop the least recently used SSD replicas of ``seg`` until ``bytes_to_free`` are freed."""
        if bytes_to_free <= 0:
            return 0
        now = self._clock.monotonic()
        candidates = self._ssd_candidates(seg.id, now)
        # Soft-pinned objects last, each group oldest first.
        candidates.sort(key=lambda c: (c[0], c[1]))
        freed = dropped = 0
        for _soft, _last, key in candidates:
            if freed >= bytes_to_free:
                break
            got = self._drop_ssd_replica(key, seg, now)
            if got:
                freed += got
                dropped += 1
        with self._lock:
            self._c.ssd_evictions += dropped
            self._c.ssd_evicted_bytes += freed
        return dropped

    def _ssd_candidates(self, segment_id: int, now: float) -> list[tuple[bool, float, str]]:
        out: list[tuple[bool, float, str]] = []
        for shard in self._shards:
            with shard.lock:
                for key, meta in shard.objects.items():
                    if _ssd_evictable(meta, segment_id, now):
                        out.append((meta.soft_pin_until > now, meta.last_access, key))
        return out

    def _drop_ssd_replica(self, key: str, seg: Segment, now: float) -> int:
        shard: Shard = self._shards.shard_of(key.encode())
        ranges: list[Range] = []
        with self._stripes.lock_for(key):
            with shard.lock:
                meta = shard.objects.get(key)
                if meta is None or not _ssd_evictable(meta, seg.id, now):
                    return 0
                replicas = meta.replica_list()
                rest = [r for r in replicas if r.segment_id != seg.id]
                if rest:
                    meta.set_replicas(rest)
                    ranges = self._resolve([r for r in replicas if r.segment_id == seg.id])
                else:
                    del shard.objects[key]
                    ranges = self._resolve(replicas)
                size = meta.size
            self._free_ranges(ranges, key)
        return size

    # ------------------------------------------------------------------ views

    def stats(self) -> dict[str, int]:
        capacity = used = 0
        for seg in self._table.segments():
            if seg.tier:
                capacity += seg.size
                used += seg.allocator.used
        with self._lock:
            c = self._c
            out = {
                "ssd_capacity_bytes": capacity,
                "ssd_used_bytes": used,
                "demotions": c.demotions,
                "demoted_bytes": c.demoted_bytes,
                "demote_failures": c.demote_failures,
                "promotions": c.promotions,
                "promote_failures": c.promote_failures,
                "dram_dropped": c.dram_dropped,
                "dram_dropped_urgent": c.dram_dropped_urgent,
                "burst_dropped": c.burst_dropped,
                "burst_dropped_bytes": c.burst_dropped_bytes,
                "ssd_evictions": c.ssd_evictions,
                "ssd_evicted_bytes": c.ssd_evicted_bytes,
                "tier_tasks_expired": c.tasks_expired,
                "demote_pending_bytes": c.pending_bytes,
                "puts_backpressured": c.puts_backpressured,
                "ssd_read_granted_bytes": c.ssd_read_granted_bytes,
                **_rates(self._io_samples),
            }
            channels = list(self._channels.values())
        out["tier_tasks_pending"] = sum(ch.pending() for ch in channels)
        return out


def _rates(samples: deque[tuple[float, int, int]]) -> dict[str, int]:
    """SSD write (demotions) and read (granted) bytes per second over the sampled window."""
    if len(samples) < 2 or samples[-1][0] <= samples[0][0]:
        return {"ssd_write_bps": 0, "ssd_read_bps": 0}
    (t0, w0, r0), (t1, w1, r1) = samples[0], samples[-1]
    return {"ssd_write_bps": int((w1 - w0) / (t1 - t0)), "ssd_read_bps": int((r1 - r0) / (t1 - t0))}


def _still_victim(meta: ObjectMeta, cand: Candidate, now: float) -> bool:
    """The DRAM eviction's re-validation (the same rule as Evictor._evict_one in evictor.py)."""
    return (
        meta.flags & _EVICTABLE_MASK == COMPLETE
        and meta.lease_until <= now
        and meta.last_access == cand.last_access
        and (cand.soft_pinned or meta.soft_pin_until <= now)
        and meta.all_replicas_complete()
    )


def _ssd_evictable(meta: ObjectMeta, segment_id: int, now: float) -> bool:
    if meta.flags & _EVICTABLE_MASK != COMPLETE or meta.lease_until > now or not meta.all_replicas_complete():
        return False
    if meta.segment == segment_id:
        return True
    return meta.extra is not None and any(r.segment_id == segment_id for r in meta.replica_list())


def _find(replicas: list[Replica], segment_id: int, offset: int) -> Replica | None:
    for r in replicas:
        if r.segment_id == segment_id and r.offset == offset and not r.complete:
            return r
    return None


def _code(value: int) -> ErrorCode:
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.INTERNAL
