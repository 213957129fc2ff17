"""Store-to-store moves of object replicas: the mechanism under drain, scale-in and rebalance (pure core).

A move copies one COMPLETE replica of an object from a *source* segment to a new range on a *target* segment
and then retires the source replica. It runs in three steps:

1. :meth:`MoveEngine.plan_moves` allocates the target range (the placement policy orders the candidates;
   never a source segment, never a segment that is not OK, never one that already holds a replica of the
   object) and adds it to the object as a PROCESSING replica. The object stays readable from its source.
   While a replica is in flight, eviction and removal skip the object (MasterState's existing rule for
   "a replica in flight"), so the source range cannot be freed under the copy. Leased objects are moved:
   a lease protects the *range* a reader was given, not the object's location.
2. The task waits in the target store's queue until that store pulls it (``SyncMoves``); the store reads the
   source with the READ grant straight into its own segment at the target offset, verifies the checksum,
   records the object in its inventory and reports the result with its next pull.
3. :meth:`MoveEngine.finish_move` makes the target replica COMPLETE and takes the source replica out of the
   object at once (new readers get the target), but frees the source *range* only when the object's read
   lease at that moment has run out: a reader that was handed the source before the move finished is never
   broken. On failure the target range is freed and the object is planned again after a backoff.

A task that gets no result before its grants expire is abandoned; its target range is freed
``RECLAIM_GRACE_S`` later (the store may still be writing into it until its WRITE grant expires, exactly as
for an abandoned put).

SSD tier: a replica on an SSD-tier segment (``Segment.tier == 1``) is a replica like any other, so a drain
moves it too (Mooncake's drain skips its LOCAL_DISK replicas, issue #2817). Its READ grant carries the tier
and the store's data plane serves it from the SSD file; the copy lands in the target's DRAM segment (only
DRAM segments take allocations), from where the target's tier manager may demote it again.

Lock order: a planner lock held by the caller (drain.py) -> object stripe -> shard lock -> allocator. The
engine's own lock guards only its task tables and is a leaf: nothing else is taken while it is held.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from kvpool.common import grants
from kvpool.common.errors import ErrorCode
from kvpool.common.log import get_logger
from kvpool.master.objects import COMPLETE, ObjectMeta, Replica, ReplicaStatus
from kvpool.master.segments import Segment, SegmentStatus
from kvpool.master.shards import Shard
from kvpool.master.task_queue import TaskQueue
from kvpool.master.types import ReplicaGrant

if TYPE_CHECKING:
    from kvpool.master.state import MasterState

__all__ = [
    "MAX_IN_FLIGHT_PER_STORE",
    "MOVE_TIMEOUT_S",
    "MoveEngine",
    "MoveOutcome",
    "MovePlan",
    "MoveTask",
    "SegmentLoad",
    "rebalance_budget",
]

_log = get_logger(__name__)

MOVE_TIMEOUT_S = 30.0
"""Lifetime of a move's grants: the store must finish the copy (and report) within it."""
MAX_IN_FLIGHT_PER_STORE = 64
"""Most moves planned for one target store (queued at the master or running there). A store runs at most 32
at once (store/mover.py); the other half waits in its queue so that the store gets its next batch in the
same call that reports the last one (no round trip of idle time between batches)."""
RETRY_BACKOFF_S = 1.0
"""A failed move is planned again after this (times its failure count, at most 30 x)."""
ABANDON_GRACE_S = 5.0
"""Like state.RECLAIM_GRACE_S: wait past a WRITE grant's expiry before reusing its range (clock skew)."""
_BACKOFF_LIMIT = 100_000

_K = TypeVar("_K")
_BUSY = object()
"""_allocate_target: every eligible target store has its moves in flight."""
_READ = grants.GrantOp.READ
_WRITE = grants.GrantOp.WRITE


@dataclass(slots=True)
class MoveTask:
    """One copy for a target store to run (the wire's MoveTask)."""

    task_id: int
    key: str
    size: int
    checksum: int
    source: ReplicaGrant
    """READ grant on the source replica (its ``tier`` says DRAM or SSD)."""
    target: ReplicaGrant
    """WRITE grant on the target store's segment."""
    target_store: str
    job: str


@dataclass(frozen=True, slots=True)
class MoveOutcome:
    """What ``finish_move`` did. ``code`` OK = the object now lives on the target."""

    task_id: int
    code: ErrorCode
    key: str = ""
    job: str = ""
    size: int = 0
    source_segment: int = 0


@dataclass(slots=True)
class MovePlan:
    """The result of one planning pass."""

    tasks: list[MoveTask] = field(default_factory=list)
    retired: int = 0
    """Objects that needed no copy: another complete replica lives off the sources, so the source replica
    was only retired (drain only; e.g. an object re-adopted with two replicas after a failover)."""
    retired_bytes: int = 0
    no_room: int = 0
    """Objects for which no target segment had room (or none was eligible)."""
    no_room_bytes: int = 0
    scanned_shards: int = 0
    busy: bool = False
    """The pass stopped because every eligible target store had its moves in flight (not a lack of room)."""
    wrapped: bool = False
    """The scan went over every shard in this pass."""


@dataclass(frozen=True, slots=True)
class SegmentLoad:
    """A segment as rebalancing sees it."""

    id: int
    size: int
    used: int


@dataclass(slots=True)
class _Move:
    task: MoveTask
    source: Segment
    source_offset: int
    target: Segment
    target_offset: int
    deadline: float
    """Monotonic time at which the grants expire."""
    delivered: bool = False


def rebalance_budget(
    segments: Iterable[SegmentLoad], tolerance: float, outgoing: Mapping[int, int] | None = None
) -> tuple[dict[int, int], set[int], float]:
    """Which segments shed how many bytes, and which receive, to bring used fractions within ``tolerance``.

    Returns (bytes to shed per source segment, target segment ids, spread = max - min used fraction).
    Sources are the segments above the mean by more than half the tolerance; each sheds down to the mean,
    minus the bytes already on their way out (``outgoing``). Targets are the segments below the mean.
    """
    segs = [s for s in segments if s.size > 0]
    if len(segs) < 2:
        return {}, set(), 0.0
    fractions = {s.id: s.used / s.size for s in segs}
    spread = max(fractions.values()) - min(fractions.values())
    if spread <= tolerance:
        return {}, set(), spread
    mean = sum(s.used for s in segs) / sum(s.size for s in segs)
    pending = outgoing or {}
    budget: dict[int, int] = {}
    for s in segs:
        if fractions[s.id] > mean + tolerance / 2:
            shed = int(s.used - mean * s.size) - pending.get(s.id, 0)
            if shed > 0:
                budget[s.id] = shed
    targets = {s.id for s in segs if fractions[s.id] < mean}
    return budget, targets, spread


class MoveEngine:
    """Plans, hands out and finishes moves on one MasterState; see the module docstring."""

    def __init__(
        self,
        state: MasterState,
        timeout_s: float = MOVE_TIMEOUT_S,
        max_per_store: int = MAX_IN_FLIGHT_PER_STORE,
    ) -> None:
        self.state = state
        self.timeout_s = timeout_s
        self.max_per_store = max_per_store
        # Internals of the pure core this engine extends (same package; the same locks and rules apply).
        self._shards = state._shards
        self._stripes = state._stripes
        self._table = state._table
        self._clock = state._clock
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._moves: dict[int, _Move] = {}
        self._queued: dict[str, TaskQueue[int]] = {}
        """Target store -> its moves by task id: queued until the store pulls them, then in flight
        (master/task_queue.py, the pipeline tier tasks use too)."""
        self._per_store: dict[str, int] = {}
        self._per_job: dict[str, int] = {}
        self._outgoing: dict[int, int] = {}
        """Source segment id -> bytes of its moves in flight (rebalancing counts them as already gone)."""
        self._retiring: list[tuple[float, int, Segment, int, int, str]] = []  # (.., seg, offset, size, key)
        """Heap of (free at, tie-breaker, segment, offset, bytes): ranges out of the index, freed when due."""
        self._retiring_bytes: dict[int, int] = {}
        self._backoff: dict[str, tuple[int, float]] = {}
        """key -> (failures, monotonic time before which it is not planned again)."""
        self._cursors: dict[str, int] = {}

    # =================================================================== planning

    def plan_moves(
        self,
        limit: int,
        source_segments: Collection[int],
        *,
        job: str = "",
        targets: Collection[int] | None = None,
        budget: dict[int, int] | None = None,
        retire_redundant: bool = True,
        max_shards: int | None = None,
        max_objects: int | None = None,
    ) -> MovePlan:
        """Start up to ``limit`` moves of objects with a COMPLETE replica on a ``source_segments`` segment.

        ``targets`` restricts the target segments (rebalance); ``budget`` (source id -> bytes, decremented
        here) stops taking objects from a source once it has shed enough. ``retire_redundant`` (drain): an
        object that already has a complete replica outside the sources and for which no target has room is
        not copied; its source replica is only retired. The scan resumes where the job's last pass stopped
        and covers at most ``max_shards`` shards (default: all), stopping after the shard where it has looked
        at ``max_objects`` objects (bounds the work of one call). Objects still PROCESSING, with a move (or
        another copy) in flight, or in their retry backoff are skipped: a later pass finds them.
        """
        plan = MovePlan()
        sources = frozenset(source_segments)
        if limit <= 0 or not sources:
            return plan
        shards = self._shards.shards
        nshards = len(shards)
        cursor = self._cursors.get(job, 0) % nshards
        todo = nshards if max_shards is None else min(nshards, max_shards)
        now = self._clock.monotonic()
        looked = 0
        while plan.scanned_shards < todo and len(plan.tasks) < limit and not plan.busy:
            if max_objects is not None and looked >= max_objects:
                break
            shard = shards[(cursor + plan.scanned_shards) % nshards]
            plan.scanned_shards += 1
            with shard.lock:
                looked += len(shard.objects)
                keys = [k for k, m in shard.objects.items() if _movable(m, sources)]
            for key in keys:
                if len(plan.tasks) >= limit or plan.busy:
                    break
                if budget is not None and not any(v > 0 for v in budget.values()):
                    break
                if self._in_backoff(key, now):
                    continue
                self._plan_one(key, sources, job, targets, budget, retire_redundant, plan)
        plan.wrapped = plan.scanned_shards >= nshards
        # Resume at the shard where this pass stopped: it may hold more candidates.
        self._cursors[job] = (cursor + max(plan.scanned_shards - 1, 0)) % nshards
        return plan

    def _plan_one(
        self,
        key: str,
        sources: frozenset[int],
        job: str,
        targets: Collection[int] | None,
        budget: dict[int, int] | None,
        retire_redundant: bool,
        plan: MovePlan,
    ) -> None:
        kb = key.encode()
        shard = self._shards.shard_of(kb)
        by_id = self._table.by_id
        with self._stripes.lock_for(key):
            with shard.lock:
                meta = shard.objects.get(key)
                if meta is None or not _movable(meta, sources):
                    return
                replicas = meta.replica_list()
                source = _pick_source(replicas, sources, budget, by_id)
                if source is None:
                    return
                size, checksum = meta.size, meta.checksum
                holding = {r.segment_id for r in replicas}
                # Another complete replica on an OK segment (not one being drained by another job).
                redundant = any(
                    r.complete
                    and r.segment_id not in sources
                    and (s := by_id.get(r.segment_id)) is not None
                    and s.status == SegmentStatus.OK
                    for r in replicas
                )
            # An SSD copy is the tier's cache of a DRAM object, not a replica the writer asked for: once the
            # object lives elsewhere (its DRAM replica was moved first), the SSD copy is only retired.
            if retire_redundant and redundant and _tier(by_id.get(source.segment_id)):
                if self._retire_only(key, shard, meta, source):
                    plan.retired += 1
                    plan.retired_bytes += size
                return
            placed = self._allocate_target(key, size, sources | holding, targets)
            if placed is _BUSY:
                plan.busy = True  # wait for a free slot: do not count it as "no room", do not retire
                return
            if placed is None:
                plan.no_room += 1
                plan.no_room_bytes += size
                if retire_redundant and redundant and self._retire_only(key, shard, meta, source):
                    plan.retired += 1
                    plan.retired_bytes += size
                return
            assert isinstance(placed, tuple)
            target, target_offset = placed
            src_seg = by_id.get(source.segment_id)
            with shard.lock:
                ok = (
                    shard.objects.get(key) is meta
                    and _movable(meta, sources)
                    and not target.removed
                    and src_seg is not None
                    and not src_seg.removed
                    and any(r == source for r in meta.replica_list())
                )
                if ok:
                    meta.add_replica(target.id, target_offset, False)
            if not ok or src_seg is None:
                target.allocator.free(target_offset)  # nothing was written there: no store notification
                return
        if budget is not None:
            budget[source.segment_id] = budget.get(source.segment_id, 0) - size
        plan.tasks.append(self._register(key, kb, size, checksum, src_seg, source.offset, target, target_offset, job))

    def _allocate_target(
        self, key: str, size: int, exclude: Collection[int], targets: Collection[int] | None
    ) -> tuple[Segment, int] | object | None:
        """A range on an OK segment the placement policy prefers, on a store with a free move slot;
        ``_BUSY`` when no free store has room but a store at its limit may have; None when none has."""
        with self._lock:
            busy = {s for s, n in self._per_store.items() if n >= self.max_per_store}
        eligible = [s for s in self._table.allocatable if s.id not in exclude and (targets is None or s.id in targets)]
        candidates = [s for s in eligible if s.store_id not in busy]
        waiting = len(candidates) < len(eligible)
        if not candidates:
            return _BUSY if waiting else None
        order = self.state._placement.choose(candidates, size, 1, set(), (), "")
        by_id = self._table.by_id
        for segment_id in order:
            seg = by_id.get(segment_id)
            if seg is None or seg.status != SegmentStatus.OK or seg.removed or segment_id in exclude:
                continue
            offset = seg.allocate_for(key, size)  # not where a free of this key is still unacknowledged
            if offset is not None:
                return seg, offset
        return _BUSY if waiting else None

    def _register(
        self,
        key: str,
        kb: bytes,
        size: int,
        checksum: int,
        source: Segment,
        source_offset: int,
        target: Segment,
        target_offset: int,
        job: str,
    ) -> MoveTask:
        now = self._clock.monotonic()
        expiry_ms = self._clock.wall_ms() + int(self.timeout_s * 1000)
        task_id = next(self._ids)
        task = MoveTask(
            task_id,
            key,
            size,
            checksum,
            ReplicaGrant(
                source.id,
                source.node,
                source.tcp_endpoint,
                source.shm_path,
                source_offset,
                size,
                expiry_ms,
                source.sign(_READ, source_offset, size, expiry_ms, kb),
                tier=_tier(source),
            ),
            ReplicaGrant(
                target.id,
                target.node,
                target.tcp_endpoint,
                target.shm_path,
                target_offset,
                size,
                expiry_ms,
                target.sign(_WRITE, target_offset, size, expiry_ms, kb),
            ),
            target.store_id,
            job,
        )
        move = _Move(task, source, source_offset, target, target_offset, now + self.timeout_s)
        with self._lock:
            self._moves[task_id] = move
            self._queue_of(target.store_id).push(task_id)
            self._per_store[target.store_id] = self._per_store.get(target.store_id, 0) + 1
            self._per_job[job] = self._per_job.get(job, 0) + 1
            self._outgoing[source.id] = self._outgoing.get(source.id, 0) + size
        return task

    def _retire_only(self, key: str, shard: Shard, meta: ObjectMeta, source: Replica) -> bool:
        """Drop the source replica of an object that has another complete one (stripe held)."""
        seg = self._table.by_id.get(source.segment_id)
        with shard.lock:
            if shard.objects.get(key) is not meta or seg is None:
                return False
            replicas = meta.replica_list()
            keep = [r for r in replicas if r != source]
            if len(keep) == len(replicas) or not any(r.complete for r in keep):
                return False
            meta.set_replicas(keep)
            free_at = meta.lease_until
        self._retire(seg, source.offset, meta.size, free_at, key)
        return True

    # =================================================================== delivery

    def take_tasks(self, store_id: str, limit: int) -> list[MoveTask]:
        """Hand up to ``limit`` queued tasks to their target store (oldest first)."""
        out: list[MoveTask] = []
        with self._lock:
            queue = self._queued.get(store_id)
            for task_id in queue.take(limit) if queue is not None else []:
                move = self._moves[task_id]
                move.delivered = True
                out.append(move.task)
        return out

    def pending_for(self, store_id: str) -> int:
        """Tasks queued for ``store_id`` and not handed out yet."""
        queue = self._queued.get(store_id)
        return queue.queued() if queue is not None else 0

    def _queue_of(self, store_id: str) -> TaskQueue[int]:
        queue = self._queued.get(store_id)
        if queue is None:
            queue = self._queued[store_id] = TaskQueue(_same)
        return queue

    def in_flight(self, job: str | None = None) -> int:
        """Moves planned and not finished (of one job, or all)."""
        if job is None:
            return len(self._moves)
        return self._per_job.get(job, 0)

    def outgoing(self) -> dict[int, int]:
        """Segment id -> bytes that will leave it: sources of moves in flight and ranges waiting to be freed
        (rebalancing counts them as gone, or it would move too much while leases run out)."""
        with self._lock:
            out = dict(self._outgoing)
            for segment_id, size in self._retiring_bytes.items():
                out[segment_id] = out.get(segment_id, 0) + size
            return out

    def retiring_bytes(self, segment_ids: Collection[int]) -> int:
        """Bytes of ``segment_ids`` waiting to be freed (leases of moved objects, abandoned grants)."""
        with self._lock:
            return sum(self._retiring_bytes.get(sid, 0) for sid in segment_ids)

    def retiring(self) -> int:
        """Ranges out of the index whose freeing waits for a lease (or an abandoned grant)."""
        return len(self._retiring)

    # =================================================================== finishing

    def finish_move(self, task_id: int, ok: bool) -> MoveOutcome:
        """Apply a store's result. Unknown task (finished, abandoned, another leader's) -> JOB_NOT_FOUND."""
        move = self._pop(task_id)
        if move is None:
            return MoveOutcome(task_id, ErrorCode.JOB_NOT_FOUND)
        return self._complete(move, ok, target_free_at=None)

    def cancel(self, job: str) -> int:
        """Revoke the job's moves that no store has taken yet (their targets were never written). Moves a
        store is running finish normally. Returns how many were revoked."""
        with self._lock:
            doomed = [tid for tid, m in self._moves.items() if m.task.job == job and not m.delivered]
        revoked = 0
        for task_id in doomed:
            move = self._pop(task_id)
            if move is not None:
                self._complete(move, False, target_free_at=None, backoff=False)
                revoked += 1
        return revoked

    def expire(self) -> list[MoveOutcome]:
        """Abandon moves whose grants expired without a result (the store died or lost them)."""
        now = self._clock.monotonic()
        with self._lock:
            due = [tid for tid, m in self._moves.items() if m.deadline <= now]
        out: list[MoveOutcome] = []
        for task_id in due:
            move = self._pop(task_id)
            if move is None:
                continue
            # A store that took the task may still write until its grant expires: free the range later.
            free_at = move.deadline + ABANDON_GRACE_S if move.delivered else None
            out.append(self._complete(move, False, target_free_at=free_at))
        return out

    def reap(self) -> int:
        """Free the retired ranges that are due; returns how many."""
        now = self._clock.monotonic()
        due: list[tuple[Segment, int, str]] = []
        with self._lock:
            while self._retiring and self._retiring[0][0] <= now:
                _, _, seg, offset, size, key = heapq.heappop(self._retiring)
                _dec(self._retiring_bytes, seg.id, size)
                due.append((seg, offset, key))
        for seg, offset, key in due:
            self._free(seg, offset, key)
        return len(due)

    def _pop(self, task_id: int) -> _Move | None:
        with self._lock:
            move = self._moves.pop(task_id, None)
            if move is None:
                return None
            task = move.task
            queue = self._queued.get(task.target_store)
            if queue is not None:
                queue.withdraw(task_id)
            _dec(self._per_store, task.target_store, 1)
            _dec(self._per_job, task.job, 1)
            _dec(self._outgoing, move.source.id, task.size)
            return move

    def _complete(self, move: _Move, ok: bool, target_free_at: float | None, backoff: bool = True) -> MoveOutcome:
        """Apply one finished (or failed) move to its object, under the object's stripe."""
        task = move.task
        key = task.key
        shard = self._shards.shard_of(key.encode())
        target_entry = Replica(move.target.id, move.target_offset, ReplicaStatus.PROCESSING)
        source_entry = Replica(move.source.id, move.source_offset, ReplicaStatus.COMPLETE)
        free_target = retire_source = False
        lease_until = 0.0
        with self._stripes.lock_for(key):
            with shard.lock:
                meta = shard.objects.get(key)
                replicas = meta.replica_list() if meta is not None else []
                found = meta is not None and target_entry in replicas and not move.target.removed
                if found and meta is not None:
                    if ok:
                        keep = [
                            Replica(r.segment_id, r.offset, ReplicaStatus.COMPLETE) if r == target_entry else r
                            for r in replicas
                            if r != source_entry
                        ]
                        retire_source = len(keep) < len(replicas)
                        lease_until = meta.lease_until
                    else:
                        keep = [r for r in replicas if r != target_entry]
                        free_target = True
                    if keep:
                        meta.set_replicas(keep)
                    else:
                        # The source went away (its store expired) and the copy failed: nothing is left.
                        del shard.objects[key]
        if free_target:
            if target_free_at is None:
                self._free(move.target, move.target_offset, key)
            else:
                self._retire(move.target, move.target_offset, task.size, target_free_at, key)
        if retire_source:
            self._retire(move.source, move.source_offset, task.size, lease_until, key)
        if found and ok:
            self._backoff.pop(key, None)
            return MoveOutcome(task.task_id, ErrorCode.OK, key, task.job, task.size, move.source.id)
        if backoff:
            self._note_failure(key)
        code = ErrorCode.TRANSFER_FAILED if found or not ok else ErrorCode.SEGMENT_NOT_FOUND
        return MoveOutcome(task.task_id, code, key, task.job, task.size, move.source.id)

    def _retire(self, seg: Segment, offset: int, size: int, free_at: float, key: str) -> None:
        """Free now if no lease can still read the range, else when the lease has run out."""
        if free_at <= self._clock.monotonic():
            self._free(seg, offset, key)
            return
        with self._lock:
            heapq.heappush(self._retiring, (free_at, next(self._ids), seg, offset, size, key))
            self._retiring_bytes[seg.id] = self._retiring_bytes.get(seg.id, 0) + size

    def _free(self, seg: Segment, offset: int, key: str) -> None:
        if seg.removed:
            return  # the allocator went with the segment
        self.state._free_ranges([(seg, offset)], key)

    # =================================================================== retries

    def _in_backoff(self, key: str, now: float) -> bool:
        entry = self._backoff.get(key)
        return entry is not None and entry[1] > now

    def _note_failure(self, key: str) -> None:
        failures = self._backoff.get(key, (0, 0.0))[0] + 1
        if len(self._backoff) >= _BACKOFF_LIMIT:
            self._backoff.clear()  # bounded memory; at worst a failing object is retried sooner
        self._backoff[key] = (failures, self._clock.monotonic() + RETRY_BACKOFF_S * min(failures, 30))


def _same(task_id: int) -> int:
    return task_id


def _movable(meta: ObjectMeta, sources: frozenset[int]) -> bool:
    """COMPLETE, no replica in flight, and a complete replica on a source segment."""
    if not meta.flags & COMPLETE or not meta.all_replicas_complete():
        return False
    if meta.segment in sources:
        return True
    extra = meta.extra
    return extra is not None and any(r.segment_id in sources for r in meta.replica_list())


def _pick_source(
    replicas: list[Replica],
    sources: frozenset[int],
    budget: dict[int, int] | None,
    by_id: Mapping[int, Segment],
) -> Replica | None:
    """The complete replica on a source segment to copy from: a DRAM one first (faster to read, and the SSD
    copy is then merely retired)."""
    found = [
        r
        for r in replicas
        if r.complete and r.segment_id in sources and (budget is None or budget.get(r.segment_id, 0) > 0)
    ]
    found.sort(key=lambda r: _tier(by_id.get(r.segment_id)))
    return found[0] if found else None


def _tier(seg: Segment | None) -> int:
    """0 = DRAM, 1 = SSD tier (``Segment.tier``; a segment without the attribute is DRAM)."""
    return int(getattr(seg, "tier", 0)) if seg is not None else 0


def _dec(counts: dict[_K, int], key: _K, amount: int) -> None:
    value = counts.get(key, 0) - amount
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)
