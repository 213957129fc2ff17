"""Drain jobs, scale-in and rebalance: the policy and the bookkeeping around the move engine (moves.py).

A **drain job** is named after what it drains: a node name (every segment of that node, DRAM and SSD tier),
or a store id or a segment id. While the job runs, its segments are DRAINING (readable, no new
allocations) and the controller keeps the move engine busy moving their live objects to other segments;
a segment whose allocator holds nothing any more (no object, no put in flight, no retired range a lease may
still read) becomes DRAINED, and the job is DRAINED when all its segments are. A scale-in job
(``remove``) then unmounts the segments and stays as a REMOVED tombstone of the drained stores, so a store
process that keeps running re-mounts as DRAINED instead of taking new objects (``undrain`` clears it).

Durability: with etcd (``attach_intents``) every job is a durable intent (``/kvpool/<cluster>/intents/
drain/<name>``) written before the operator gets an answer; progress is recorded about once a second.
A new leader loads the intents after its election (:meth:`resume`), and marks each job's segments
DRAINING as the node's stores re-mount, so an unfinished drain carries on. Until the intents are loaded,
drain calls answer LEADER_WARMING_UP (clients retry). Without etcd the jobs live in master memory only.

**Rebalance** (after a scale-out) moves objects from the fullest OK segments to the emptiest until the
used fractions are within a tolerance (or ``max_moves``); it is in memory only (re-run it after a failover).

Threads: the controller thread runs :meth:`tick` (planning, state changes, expiry, persistence); the
service's loop runs the RPCs (:meth:`sync` for the stores, :meth:`start` / :meth:`undrain` / the status
calls for the admin). Lock order: ``_plan_lock`` (job structure and planning) is outermost and comes
before every MasterState lock; ``_lock`` guards only the counters and is a leaf.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger
from kvpool.master.moves import (
    MAX_IN_FLIGHT_PER_STORE,
    MoveEngine,
    MoveOutcome,
    MovePlan,
    MoveTask,
    SegmentLoad,
    rebalance_budget,
)
from kvpool.master.segments import Segment, SegmentStatus
from kvpool.master.state import MasterState

__all__ = [
    "DRAINED",
    "REMOVED",
    "RUNNING",
    "STALLED",
    "WAITING",
    "DrainController",
    "DrainJob",
    "DrainManager",
    "DrainStatus",
    "RebalanceStatus",
]

log = get_logger(__name__)

RUNNING = "RUNNING"
"""Objects are being moved (or waited for: puts in flight, leases of retired ranges)."""
STALLED = "STALLED"
"""No target segment had room for the remaining objects for STALL_AFTER_S: nothing can move."""
WAITING = "WAITING"
"""No segment of the job is mounted (e.g. after a failover, until the node's stores re-mount)."""
DRAINED = "DRAINED"
REMOVED = "REMOVED"
"""Scale-in done: the segments were unmounted once DRAINED."""
CANCELLED = "CANCELLED"

INTENT_KIND = "drain"
STALL_AFTER_S = 2.0
PERSIST_EVERY_S = 1.0
PLAN_PER_TICK = 512
"""Most moves planned per controller tick (bounds the time the tick holds the planner)."""
OBJECTS_PER_TICK = 20_000
"""A planning pass stops after the shard where it has looked at this many objects (the next tick goes on
from there): bounds how long one tick holds the interpreter (a few ms)."""
REBALANCE_JOB = "rebalance"


class IntentStoreLike(Protocol):
    """What the manager needs from kvpool.master.intents.IntentStore."""

    def put(self, kind: str, name: str, doc: dict[str, Any]) -> int: ...

    def list(self, kind: str) -> Sequence[Any]: ...

    def delete(self, kind: str, name: str, expected_revision: int | None = None) -> bool: ...


@dataclass
class DrainJob:
    node: str
    started_ms: int
    remove: bool = False
    finished_ms: int = 0
    objects_moved: int = 0
    bytes_moved: int = 0
    failures: int = 0
    removed_stores: list[str] = field(default_factory=list)
    state: str = RUNNING
    message: str = ""
    no_room_since: float | None = None
    dirty: bool = True
    persisted_at: float = 0.0

    @property
    def key(self) -> str:
        """The move engine's job name."""
        return "drain:" + self.node

    def to_doc(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "remove": self.remove,
            "state": self.state,
            "started_ms": self.started_ms,
            "finished_ms": self.finished_ms,
            "objects_moved": self.objects_moved,
            "bytes_moved": self.bytes_moved,
            "failures": self.failures,
            "removed_stores": list(self.removed_stores),
        }

    @classmethod
    def from_doc(cls, name: str, doc: dict[str, Any]) -> DrainJob:
        def num(field_name: str) -> int:
            value = doc.get(field_name, 0)
            return int(value) if isinstance(value, int | float) else 0

        stores = doc.get("removed_stores", [])
        state = str(doc.get("state", RUNNING))
        return cls(
            node=name,
            started_ms=num("started_ms"),
            remove=bool(doc.get("remove", False)),
            finished_ms=num("finished_ms"),
            objects_moved=num("objects_moved"),
            bytes_moved=num("bytes_moved"),
            failures=num("failures"),
            removed_stores=[str(s) for s in stores] if isinstance(stores, list) else [],
            state=state if state in (RUNNING, STALLED, WAITING, DRAINED, REMOVED) else RUNNING,
            dirty=False,
        )


@dataclass(frozen=True)
class DrainStatus:
    node: str
    state: str
    objects_moved: int
    bytes_moved: int
    objects_remaining: int
    """Allocations still on the job's segments: objects, puts in flight, retired ranges awaiting a lease."""
    bytes_remaining: int
    in_flight: int
    seconds: float
    message: str = ""
    segment_ids: tuple[int, ...] = ()
    failures: int = 0
    remove: bool = False


@dataclass
class _Rebalance:
    max_moves: int
    tolerance: float
    started: float
    state: str = RUNNING
    objects_moved: int = 0
    bytes_moved: int = 0
    planned: int = 0
    spread: float = 0.0
    message: str = ""
    finished: float = 0.0
    idle_shards: int = 0
    """Shards scanned since the last planned move: a whole map's worth means nothing more can move."""


@dataclass(frozen=True)
class RebalanceStatus:
    state: str
    """IDLE | RUNNING | DONE"""
    objects_moved: int = 0
    bytes_moved: int = 0
    in_flight: int = 0
    spread: float = 0.0
    seconds: float = 0.0
    message: str = ""
    planned: int = 0


class DrainManager:
    """Drain, scale-in and rebalance jobs of one master; see the module docstring."""

    def __init__(
        self,
        state: MasterState,
        serving: Callable[[], bool] = lambda: True,
        max_per_store: int = MAX_IN_FLIGHT_PER_STORE,
    ) -> None:
        self._serving = serving
        self._max_per_store = max_per_store
        self._plan_lock = threading.RLock()
        self._lock = threading.Lock()
        self._intents: IntentStoreLike | None = None
        self._generation = 0
        self._wake = threading.Event()
        self._bind(state)

    def _bind(self, state: MasterState) -> None:
        self.state = state
        self.engine = MoveEngine(state, max_per_store=self._max_per_store)
        self.jobs: dict[str, DrainJob] = {}
        self._rebalance: _Rebalance | None = None
        self.loaded = self._intents is None

    # =================================================================== lifecycle

    def attach_intents(self, intents: IntentStoreLike) -> None:
        """Keep jobs in etcd from now on; jobs are loaded by :meth:`resume` once this master leads."""
        with self._plan_lock:
            self._intents = intents
            self.loaded = False

    def reset(self, state: MasterState) -> None:
        """Forget every job and move (a deposed leader, or a fresh index): a later leadership reloads them."""
        with self._plan_lock:
            self._generation += 1
            self._bind(state)

    def resume(self, attempts: int = 10) -> int:
        """Load the durable drain jobs (a newly elected leader). Returns how many were loaded."""
        intents = self._intents
        if intents is None:
            self.loaded = True
            return 0
        generation = self._generation
        for attempt in range(attempts):
            try:
                stored = list(intents.list(INTENT_KIND))
                break
            except KvPoolError as exc:
                log.warning("cannot load drain jobs from etcd (attempt %d): %s", attempt + 1, exc)
                time.sleep(min(2.0, 0.2 * (attempt + 1)))
        else:
            return 0
        with self._plan_lock:
            if generation != self._generation:
                return 0  # deposed (and reset) while loading
            for intent in stored:
                if intent.name not in self.jobs:
                    self.jobs[intent.name] = DrainJob.from_doc(intent.name, intent.doc)
            self.loaded = True
            for job in self.jobs.values():
                self._mark_draining(job)
        if stored:
            log.info("resumed %d drain jobs from etcd: %s", len(stored), ", ".join(i.name for i in stored))
        self._wake.set()
        return len(stored)

    # =================================================================== operator calls

    def start(self, node: str, remove: bool = False) -> DrainStatus:
        """Start draining ``node`` (idempotent; ``remove`` turns a running drain into a scale-in)."""
        self._check_loaded()
        if not node:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "drain needs a node name")
        with self._plan_lock:
            job = self.jobs.get(node)
            if job is None:
                if not self._match(node, None):
                    raise KvPoolError(ErrorCode.SEGMENT_NOT_FOUND, f"no mounted segment on node {node!r}")
                job = DrainJob(node, self.state._clock.wall_ms(), remove=remove)
                # Durable before the operator hears "started": a new leader must find it.
                self._persist_now(job)
                self.jobs[node] = job
                log.info("drain of %s started%s", node, " (scale-in)" if remove else "")
            elif remove and not job.remove:
                job.remove = True
                self._persist_now(job)
            self._mark_draining(job)
        self._wake.set()
        return self.status(node)

    def undrain(self, node: str) -> DrainStatus:
        """Cancel a drain (or clear a scale-in tombstone): segments back to OK, queued moves revoked; moves a
        store is running finish (the object simply ends up on its target)."""
        self._check_loaded()
        with self._plan_lock:
            job = self.jobs.pop(node, None)
            if job is None:
                raise KvPoolError(ErrorCode.JOB_NOT_FOUND, f"no drain job for {node!r}")
            revoked = self.engine.cancel(job.key)
            segments = self._segments_of(job)
            ids = [s.id for s in segments if s.status != SegmentStatus.OK]
            if ids:
                self.state.set_segment_status(ids, SegmentStatus.OK)
            status = self._status_of(job, segments)
        if self._intents is not None:
            self._intents.delete(INTENT_KIND, node)
        log.info("drain of %s cancelled: %d segments back to OK, %d queued moves revoked", node, len(ids), revoked)
        return DrainStatus(
            status.node,
            CANCELLED,
            status.objects_moved,
            status.bytes_moved,
            status.objects_remaining,
            status.bytes_remaining,
            status.in_flight,
            status.seconds,
            f"{len(ids)} segments back to OK",
            status.segment_ids,
            status.failures,
            job.remove,
        )

    # Status reads take no planner lock: they run on the service's loop (and the metrics thread) and must
    # not wait behind a planning pass. A job's fields are read racily: fine for progress reports.

    def status(self, node: str) -> DrainStatus:
        self._check_loaded()
        job = self.jobs.get(node)
        if job is None:
            raise KvPoolError(ErrorCode.JOB_NOT_FOUND, f"no drain job for {node!r}")
        return self._status_of(job, self._segments_of(job))

    def statuses(self) -> list[DrainStatus]:
        self._check_loaded()
        return [self._status_of(job, self._segments_of(job)) for _, job in sorted(list(self.jobs.items()))]

    def start_rebalance(self, max_moves: int = 0, tolerance: float = 0.05) -> RebalanceStatus:
        """Start (or restart) a rebalance; ``max_moves`` 0 = no limit."""
        if not 0.0 <= tolerance < 1.0:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"tolerance must be in [0, 1), got {tolerance}")
        with self._plan_lock:
            rb = _Rebalance(max_moves if max_moves > 0 else 1 << 62, tolerance, self.state._clock.monotonic())
            rb.spread = rebalance_budget(self._rebalance_loads(), tolerance)[2]
            self._rebalance = rb
        self._wake.set()
        return self.rebalance_status()

    def rebalance_status(self) -> RebalanceStatus:
        rb = self._rebalance
        if rb is None:
            return RebalanceStatus("IDLE")
        end = rb.finished or self.state._clock.monotonic()
        return RebalanceStatus(
            rb.state,
            rb.objects_moved,
            rb.bytes_moved,
            self.engine.in_flight(REBALANCE_JOB),
            rb.spread,
            end - rb.started,
            rb.message,
            rb.planned,
        )

    # =================================================================== stores

    def sync(self, store_id: str, results: Iterable[tuple[int, ErrorCode]], max_tasks: int) -> list[MoveTask]:
        """A store reports finished moves and takes new ones (at most ``max_tasks``)."""
        outcomes = [self.engine.finish_move(task_id, code == ErrorCode.OK) for task_id, code in results]
        self._account(outcomes)
        tasks = self.engine.take_tasks(store_id, max(0, min(max_tasks, self._max_per_store)))
        if outcomes or not tasks:
            self._wake.set()  # results free slots and may finish segments: let the controller plan now
        return tasks

    def pending_for(self, store_id: str) -> int:
        return self.engine.pending_for(store_id)

    def on_mount(self, segment_id: int) -> None:
        """A segment (re-)mounted: if a drain job covers it, it is DRAINING at once."""
        if not self.loaded:
            return  # resume() marks the segments once the jobs are loaded
        seg = self.state._table.get(segment_id)
        if seg is None:
            return
        with self._plan_lock:
            for job in self.jobs.values():
                if self._covers(job, seg):
                    self._mark_draining(job)
                    self._wake.set()
                    return

    # =================================================================== controller

    def active(self) -> bool:
        rb = self._rebalance
        return (
            bool(self.jobs)
            or (rb is not None and rb.state == RUNNING)
            or self.engine.in_flight() > 0
            or self.engine.retiring() > 0
        )

    def tick(self) -> None:
        """One controller step: free due ranges, abandon expired moves, advance every job, persist."""
        if not self._serving():
            return
        self.engine.reap()
        self._account(self.engine.expire())
        with self._plan_lock:
            if not self.loaded:
                return
            for job in list(self.jobs.values()):
                self._advance(job)
            self._advance_rebalance()
            docs = self._due_docs()
        self._write_docs(docs)

    def wait(self, timeout: float) -> None:
        """Sleep until woken (a store reported, a job started) or ``timeout``."""
        self._wake.wait(timeout)
        self._wake.clear()

    # =================================================================== internals: jobs

    def _check_loaded(self) -> None:
        if not self.loaded:
            raise KvPoolError(ErrorCode.LEADER_WARMING_UP, "drain jobs are being loaded from etcd")

    def _covers(self, job: DrainJob, seg: Segment) -> bool:
        if job.state == REMOVED or job.removed_stores:
            return seg.store_id in job.removed_stores
        name = job.node
        return seg.node == name or seg.store_id == name or str(seg.id) == name

    def _match(self, name: str, job: DrainJob | None) -> list[Segment]:
        probe = job or DrainJob(name, 0)
        return [s for s in self.state._table.segments() if self._covers(probe, s)]

    def _segments_of(self, job: DrainJob) -> list[Segment]:
        return self._match(job.node, job)

    def _mark_draining(self, job: DrainJob) -> None:
        ids = [s.id for s in self._segments_of(job) if s.status == SegmentStatus.OK]
        if ids:
            self.state.set_segment_status(ids, SegmentStatus.DRAINING)

    def _advance(self, job: DrainJob) -> None:
        self._mark_draining(job)
        segments = self._segments_of(job)
        empty = [s.id for s in segments if s.status == SegmentStatus.DRAINING and s.allocator.used == 0]
        if empty:
            self.state.set_segment_status(empty, SegmentStatus.DRAINED)
        draining = [s.id for s in segments if s.status == SegmentStatus.DRAINING]
        if job.state == REMOVED:
            return
        if not segments:
            self._set_state(job, DRAINED if job.finished_ms else WAITING)
        elif not draining:
            self._finish(job, segments)
        else:
            self._plan(job, draining)

    def _finish(self, job: DrainJob, segments: list[Segment]) -> None:
        if not job.finished_ms:
            job.finished_ms = self.state._clock.wall_ms()
            log.info(
                "drain of %s done: %d objects (%d bytes) moved in %.1f s",
                job.node,
                job.objects_moved,
                job.bytes_moved,
                (job.finished_ms - job.started_ms) / 1000,
            )
        self._set_state(job, DRAINED)
        # Scale-in: unmount only once each store has applied every free notification, so that its inventory
        # is empty; otherwise a store that keeps running would re-mount with stale entries.
        if job.remove and all(s.store.pending() == 0 for s in segments):
            job.removed_stores = sorted({s.store_id for s in segments})
            for seg in segments:
                self.state.unmount_segment(seg.id)
            self._set_state(job, REMOVED, "segments unmounted: the store may stop")
            log.info("scale-in of %s: %d segments unmounted", job.node, len(segments))

    def _plan(self, job: DrainJob, draining: list[int]) -> None:
        now = self.state._clock.monotonic()
        targets = {s.store_id for s in self.state._table.allocatable if s.id not in draining}
        slots = min(PLAN_PER_TICK, len(targets) * self._max_per_store - self.engine.in_flight())
        if targets:
            plan = self.engine.plan_moves(slots, draining, job=job.key, max_objects=OBJECTS_PER_TICK)
        else:  # nowhere to go: every object left is "without room"
            segs = [s for s in self._segments_of(job) if s.id in draining]
            plan = MovePlan(
                no_room=sum(s.allocator.allocations for s in segs),
                no_room_bytes=sum(s.allocator.used for s in segs),
            )
        if plan.retired:
            with self._lock:
                job.objects_moved += plan.retired
                job.dirty = True
        if plan.tasks or plan.retired or self.engine.in_flight(job.key) or not plan.no_room:
            job.no_room_since = None
            busy = plan.tasks or self.engine.in_flight(job.key)
            self._set_state(job, RUNNING, "" if busy else self._waiting_for(draining))
            return
        # Nothing could be placed and nothing is moving. No eviction here: the maintenance thread keeps the
        # targets under their high watermark as moves fill them (the coldest objects go, as for puts), and
        # evicting for a drain with no target at all would only throw the draining node's objects away.
        if job.no_room_since is None:
            job.no_room_since = now
        elif now - job.no_room_since >= STALL_AFTER_S:
            where = "no other segment takes allocations" if not targets else "no target segment has room"
            self._set_state(job, STALLED, f"{where} for {plan.no_room} objects")

    def _waiting_for(self, draining: list[int]) -> str:
        """Why a running drain moves nothing right now (for the operator)."""
        held = self.engine.retiring_bytes(draining)
        if held:
            return f"waiting for read leases on {held} bytes of moved objects"
        return "waiting for puts in flight (or a retry backoff)"

    def _set_state(self, job: DrainJob, state: str, message: str = "") -> None:
        if job.state != state:
            job.persisted_at = 0.0  # state changes are recorded at once
            job.dirty = True
        job.state = state
        job.message = message

    def _status_of(self, job: DrainJob, segments: list[Segment]) -> DrainStatus:
        live = [s for s in segments if s.status != SegmentStatus.DRAINED]
        end = job.finished_ms or self.state._clock.wall_ms()
        with self._lock:
            moved, moved_bytes, failures = job.objects_moved, job.bytes_moved, job.failures
        return DrainStatus(
            job.node,
            job.state,
            moved,
            moved_bytes,
            sum(s.allocator.allocations for s in live),
            sum(s.allocator.used for s in live),
            self.engine.in_flight(job.key),
            max(0.0, (end - job.started_ms) / 1000.0),
            job.message,
            tuple(s.id for s in segments),
            failures,
            job.remove,
        )

    def _account(self, outcomes: Iterable[MoveOutcome]) -> None:
        with self._lock:
            for outcome in outcomes:
                if outcome.code == ErrorCode.JOB_NOT_FOUND:
                    continue
                if outcome.job == REBALANCE_JOB:
                    rb = self._rebalance
                    if rb is not None and outcome.code == ErrorCode.OK:
                        rb.objects_moved += 1
                        rb.bytes_moved += outcome.size
                    continue
                job = self.jobs.get(outcome.job.removeprefix("drain:"))
                if job is None:
                    continue
                if outcome.code == ErrorCode.OK:
                    job.objects_moved += 1
                    job.bytes_moved += outcome.size
                else:
                    job.failures += 1
                job.dirty = True

    # =================================================================== internals: rebalance

    def _advance_rebalance(self) -> None:
        rb = self._rebalance
        if rb is None or rb.state != RUNNING:
            return
        loads = self._rebalance_loads()
        budget, targets, spread = rebalance_budget(loads, rb.tolerance, self.engine.outgoing())
        rb.spread = spread
        in_flight = self.engine.in_flight(REBALANCE_JOB)
        if not budget or rb.planned >= rb.max_moves:
            if not in_flight:
                reason = "within tolerance" if not budget else f"max moves ({rb.planned}) reached"
                self._end_rebalance(rb, reason)
            return
        slots = min(
            PLAN_PER_TICK,
            rb.max_moves - rb.planned,
            len({s.store_id for s in self.state._table.allocatable if s.id in targets}) * self._max_per_store
            - self.engine.in_flight(),
        )
        plan = self.engine.plan_moves(
            slots,
            set(budget),
            job=REBALANCE_JOB,
            targets=targets,
            budget=budget,
            retire_redundant=False,
            max_objects=OBJECTS_PER_TICK,
        )
        rb.planned += len(plan.tasks)
        rb.idle_shards = 0 if plan.tasks else rb.idle_shards + plan.scanned_shards
        if not in_flight and rb.idle_shards >= self.state._shards.num_shards:
            self._end_rebalance(rb, "no movable object left on the fullest segments")

    def _rebalance_loads(self) -> list[SegmentLoad]:
        """The OK DRAM segments outside every drain job."""
        drained = {s.id for job in self.jobs.values() for s in self._segments_of(job)}
        return [
            SegmentLoad(s.id, s.size, s.allocator.used) for s in self.state._table.allocatable if s.id not in drained
        ]

    def _end_rebalance(self, rb: _Rebalance, reason: str) -> None:
        rb.state = "DONE"
        rb.message = reason
        rb.finished = self.state._clock.monotonic()
        log.info(
            "rebalance done (%s): %d objects (%d bytes) moved, spread %.3f",
            reason,
            rb.objects_moved,
            rb.bytes_moved,
            rb.spread,
        )

    # =================================================================== internals: persistence

    def _persist_now(self, job: DrainJob) -> None:
        if self._intents is None:
            return
        try:
            self._intents.put(INTENT_KIND, job.node, job.to_doc())
        except KvPoolError as exc:
            raise KvPoolError(
                ErrorCode.ETCD_ERROR, f"cannot record the drain of {job.node} in etcd: {exc.message}"
            ) from exc
        job.dirty = False
        job.persisted_at = time.monotonic()

    def _due_docs(self) -> list[tuple[DrainJob, dict[str, Any]]]:
        if self._intents is None:
            return []
        now = time.monotonic()
        out = []
        for job in self.jobs.values():
            if job.dirty and now - job.persisted_at >= PERSIST_EVERY_S:
                with self._lock:
                    job.dirty = False
                    doc = job.to_doc()
                job.persisted_at = now
                out.append((job, doc))
        return out

    def _write_docs(self, docs: list[tuple[DrainJob, dict[str, Any]]]) -> None:
        intents = self._intents
        if intents is None:
            return
        for job, doc in docs:
            if self.jobs.get(job.node) is not job:
                continue  # undrained meanwhile: do not resurrect its intent
            try:
                intents.put(INTENT_KIND, job.node, doc)
            except KvPoolError as exc:
                job.dirty = True
                log.warning("cannot record drain progress of %s in etcd: %s", job.node, exc)

    # =================================================================== metrics

    def collector(self) -> Collector:
        return _DrainCollector(self)


class _DrainCollector(Collector):
    """Drain progress on the master's /metrics (per job, labelled by node)."""

    def __init__(self, manager: DrainManager) -> None:
        self._manager = manager

    def collect(self) -> Any:
        manager = self._manager
        moved = CounterMetricFamily(
            "kvpool_drain_objects_moved", "Objects moved off draining segments", labels=["node"]
        )
        moved_bytes = CounterMetricFamily(
            "kvpool_drain_bytes_moved", "Bytes moved off draining segments", labels=["node"]
        )
        remaining = GaugeMetricFamily(
            "kvpool_drain_remaining_objects", "Allocations still on a drain job's segments", labels=["node"]
        )
        in_flight = GaugeMetricFamily("kvpool_drain_moves_in_flight", "Moves planned and not finished")
        try:
            statuses = manager.statuses() if manager.loaded else []
        except KvPoolError:
            statuses = []
        for st in statuses:
            moved.add_metric([st.node], st.objects_moved)
            moved_bytes.add_metric([st.node], st.bytes_moved)
            remaining.add_metric([st.node], st.objects_remaining)
        in_flight.add_metric([], manager.engine.in_flight())
        yield moved
        yield moved_bytes
        yield remaining
        yield in_flight


class DrainController(threading.Thread):
    """Runs ``DrainManager.tick`` often while there is work, rarely when idle."""

    def __init__(self, manager: DrainManager, busy_interval_s: float = 0.02, idle_interval_s: float = 0.5) -> None:
        super().__init__(name="drain-controller", daemon=True)
        self.manager = manager
        self._busy = busy_interval_s
        self._idle = idle_interval_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            manager = self.manager
            try:
                manager.tick()
            except Exception:
                log.exception("drain controller step failed")
            manager.wait(self._busy if manager.active() else self._idle)

    def stop(self) -> None:
        self._stop_event.set()
        self.manager._wake.set()
