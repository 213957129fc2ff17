"""The evictor: when the pool needs eviction, and the approximate-LRU mechanism that frees space.

``MasterState`` holds one ``Evictor`` and delegates ``needs_eviction`` and ``evict`` to it. It is a separate
object (composition, like ``TierManager``) because its state is its own: the eviction lock, the rotating shard
cursor, the carried pool of candidates and the policy. What it needs of the rest it is given: the shard map
and segment table to scan, the tier manager (demotion instead of dropping), ``drop_if`` (MasterState's
re-validate-and-free of one key) and ``count_evicted`` (the state's counters). The policy that orders victims
is eviction.py.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice

from kvpool.common.clock import Clock
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import Candidate, EvictionPolicy
from kvpool.master.objects import COMPLETE, HARD_PIN, PRIMARY_COMPLETE, ObjectMeta
from kvpool.master.segments import SegmentTable
from kvpool.master.shards import ShardMap
from kvpool.master.tiering import TierManager
from kvpool.master.types import EvictionReport

__all__ = ["EVICTION_STEP", "HANDOFF_EVERY", "MAX_EVICTION_ROUNDS", "SAMPLE_WINDOW", "EvictionWork", "Evictor"]

MAX_EVICTION_ROUNDS = 4
"""An eviction call samples again (from the next shards) while it has not freed enough, at most this often in
a row without freeing anything (a stepped eviction goes on while its steps make progress)."""

EVICTION_STEP = 32
"""Most victims one step of a background (not urgent) sampled eviction frees under the eviction lock."""
HANDOFF_EVERY = 2
"""A background step with headroom hands the interpreter to waiting puts after this many victims."""
SAMPLE_WINDOW = 64
"""Most objects a sampled pass examines in one shard per visit; the shard's next visit goes on after them
(docs/decisions/0085-sampled-eviction.md)."""

_EVICTABLE_MASK = COMPLETE | HARD_PIN
_new_candidate = tuple.__new__  # Candidate(...) without the named tuple's Python-level __new__


@dataclass(frozen=True, slots=True)
class EvictionWork:
    """Cumulative eviction work since the master started (benchmarks and tests read differences)."""

    calls: int
    examined: int
    """Objects looked at while collecting candidates (evictable or not)."""
    evicted: int
    """Objects dropped (demotions to the SSD tier are not counted)."""
    cpu_seconds: float
    """CPU time of the threads inside ``evict`` (not the time they waited for the interpreter lock)."""
    urgent_calls: int = 0
    """Calls made for a put that found the pool full (the put waited for them)."""


DropIf = Callable[[str, Callable[[ObjectMeta], bool]], "ObjectMeta | None"]
"""MasterState._drop_if: under the key's stripe, unlink and free the object if the predicate holds."""


class _Tally:
    """What one ``evict`` call has done so far, over its rounds."""

    __slots__ = (
        "examined",
        "freed",
        "gone_bytes",
        "keys",
        "last_freed",
        "objects",
        "objects_held",
        "published",
        "rounds",
        "scanned",
    )

    def __init__(self, objects_held: int) -> None:
        self.objects_held = objects_held
        self.rounds = self.objects = self.freed = self.scanned = self.gone_bytes = self.examined = 0
        self.last_freed = 0
        self.keys: list[str] = []
        self.published = (0, 0, time.thread_time())
        """(examined, objects, thread CPU time) when the counters last got this call's work."""


class Evictor:
    """Samples candidates, asks the policy for victims, re-validates and frees them (see ``evict``)."""

    def __init__(
        self,
        config: MasterConfig,
        clock: Clock,
        shards: ShardMap,
        table: SegmentTable,
        tiers: TierManager,
        policy: EvictionPolicy,
        drop_if: DropIf,
        count_evicted: Callable[[int, int], None],
        rng: random.Random,
    ) -> None:
        self._cfg = config
        self._clock = clock
        self._shards = shards
        self._table = table
        self.tiers = tiers
        self._eviction = policy
        self._drop_if = drop_if
        self._count_evicted = count_evicted
        self._evict_lock = threading.Lock()
        self._evict_cursor = rng.randrange(config.num_shards)
        self._window_starts = [0] * config.num_shards
        """Per shard: where its next sampled window starts (the position in the shard's dict order)."""
        self._pool: list[Candidate] = []
        """The best candidates a sampled round did not evict, best first, carried to the next round (under
        the eviction lock; each is re-validated before it is evicted)."""
        self._work_lock = threading.Lock()
        self._work = EvictionWork(0, 0, 0, 0.0)

    def work(self) -> EvictionWork:
        """Calls, objects examined and evicted, and CPU seconds spent, since the start."""
        with self._work_lock:
            return self._work

    def _publish(self, tally: _Tally, call_ended: bool, urgent: bool) -> None:
        """Add the call's work since its last publication to the counters. Every round publishes, so that a
        long background call's work shows while it runs (a benchmark's phase may end before the call does)."""
        examined, objects, cpu = tally.published
        now_cpu = time.thread_time()
        with self._work_lock:
            w = self._work
            self._work = EvictionWork(
                w.calls + call_ended,
                w.examined + tally.examined - examined,
                w.evicted + tally.objects - objects,
                w.cpu_seconds + now_cpu - cpu,
                w.urgent_calls + (call_ended and urgent),
            )
        tally.published = (tally.examined, tally.objects, now_cpu)

    def needs_eviction(self) -> bool:
        """used / capacity over the allocatable (OK) segments is above eviction_high_watermark."""
        capacity, used = self.allocatable_usage()
        used -= self.tiers.pending_bytes  # DRAM being demoted is as good as free
        return capacity > 0 and used > self._cfg.eviction_high_watermark * capacity

    def evict(self, bytes_to_free: int | None = None, urgent: bool = False) -> EvictionReport:
        """Approximate-LRU eviction of at least ``bytes_to_free`` bytes (default: down to eviction_target).

        Phase 1 samples candidates (COMPLETE, lease expired, not hard-pinned, no replica in flight) shard by
        shard from a rotating start, one window of at most ``SAMPLE_WINDOW`` objects per shard visit, holding
        each shard lock only while copying that window's candidates, until ``eviction_sample_factor`` x
        (estimated victims) are collected (factor 0 = every object of every shard: exact LRU).
        A sampled round adds the candidates carried from the previous round (the pool, at most
        ``eviction_pool_size``). Phase 2 asks the policy to rank them, outside every lock. Phase 3 walks that
        order, re-validating and freeing each victim under its object stripe until enough is freed; one that
        was leased, touched, pinned or removed meanwhile is skipped for the next; the best of the rest become
        the pool.
        Soft-pinned objects are candidates only if allow_evict_soft_pinned (and the policy takes them last).
        With an SSD tier, a victim may be demoted instead of dropped (master/tiering.py): it counts towards
        the bytes freed but not as an eviction; ``urgent`` (a failed allocation) always frees at once.

        A sampled eviction that is not ``urgent`` (the maintenance thread's) works in steps of at most
        ``EVICTION_STEP`` victims and lets go of the eviction lock between steps, so that a put whose
        allocation failed waits behind one step, not the whole eviction (docs/decisions/0085-sampled-eviction.md);
        while the pool has headroom its rounds hand the interpreter to waiting puts every ``HANDOFF_EVERY``
        victims. An ``urgent`` call wakes the maintenance thread (docs/decisions/0086-eviction-pool.md).
        """
        started = time.perf_counter()
        to_target = bytes_to_free is None
        stepped = not urgent and self._cfg.eviction_sample_factor > 0
        if urgent:
            self.tiers.progress.set()  # a put waits for eviction: wake the background eviction now
        tally = _Tally(self._shards.count_objects())
        fruitless = 0
        while fruitless < MAX_EVICTION_ROUNDS:
            with self._evict_lock:
                if bytes_to_free is None:
                    bytes_to_free = self.default_eviction_bytes()
                need = bytes_to_free - tally.freed
                if to_target and tally.rounds:
                    need = min(need, self.default_eviction_bytes())  # others may have freed some meanwhile
                if need <= 0 or (not urgent and self.tiers.active and self.tiers.saturated()):
                    break  # (the demotion backlog is full: victims would only be deferred)
                finished = self._round(need, urgent, stepped, tally)
            self._publish(tally, False, urgent)
            if finished:
                break
            fruitless = fruitless + 1 if tally.last_freed == 0 or not stepped else 0
        if tally.objects:
            self._count_evicted(tally.objects, tally.gone_bytes)
        self._publish(tally, True, urgent)
        return EvictionReport(tally.objects, tally.freed, tally.scanned, time.perf_counter() - started, tally.keys)

    def _round(self, need: int, urgent: bool, stepped: bool, tally: _Tally) -> bool:
        """One sample-select-free round (eviction lock held); True when there is nothing more to find."""
        limit = self._candidate_limit(need, tally.objects_held)
        if stepped and limit is not None:
            need = min(need, self._step_bytes(need, limit))
            limit = self._candidate_limit(need, tally.objects_held)
        # While the pool has headroom, a background step hands the interpreter to waiting puts (a blocking
        # call does) after its sample and every HANDOFF_EVERY victims: a put then waits for a few victims'
        # work, not for a whole switch interval. Past the headroom line the eviction runs flat out.
        handoff = stepped and self._has_headroom()
        now = self._clock.monotonic()
        candidates, looked_at, complete = self._collect_candidates(now, limit, tally.objects_held)
        if handoff:
            time.sleep(0)
        tally.rounds += 1
        tally.scanned += len(candidates)
        tally.examined += looked_at
        tally.last_freed = 0
        pool, self._pool = self._pool, []
        by_key = {c.key: c for c in candidates}
        if len(by_key) != len(candidates):
            candidates = list(by_key.values())  # a shard's windows wrapped around within this round
        pooled = limit is not None and self._cfg.eviction_pool_size > 0
        if pooled and pool:  # a fresh sample replaces the carried entry of its key (its last access is current)
            candidates = [c for c in pool if c.key not in by_key] + candidates
        if not candidates:
            return True
        # The policy orders every candidate: a victim that fails re-validation is replaced by the next one,
        # and the best of the rest are carried to the next round.
        ranked = self._eviction.rank(candidates)
        skipped = taken = 0
        for cand in ranked:
            if tally.last_freed >= need:
                break
            taken += 1
            if handoff and not taken % HANDOFF_EVERY:
                time.sleep(0)
            got, gone = self._evict_one(cand, now, urgent)
            if got:
                tally.last_freed += got
                if gone:
                    tally.objects += 1
                    tally.gone_bytes += got
                    tally.keys.append(cand.key)
            else:
                skipped += 1
        tally.freed += tally.last_freed
        if pooled:
            self._pool = ranked[taken : taken + self._cfg.eviction_pool_size]
        # A full scan whose every victim was taken: nothing else is evictable.
        return complete and not skipped and tally.last_freed < need

    def _step_bytes(self, need: int, limit: int) -> int:
        """The bytes of ``EVICTION_STEP`` victims (estimated from ``need`` and its candidate limit)."""
        victims = max(1, limit // max(1, self._cfg.eviction_sample_factor))
        return max(1, need * EVICTION_STEP // victims) if victims > EVICTION_STEP else need

    def allocatable_usage(self) -> tuple[int, int]:
        """(capacity, used bytes) of the allocatable segments."""
        capacity = used = 0
        for seg in self._table.allocatable:
            capacity += seg.size
            used += seg.allocator.used
        return capacity, used

    def urgent_eviction_bytes(self, need: int) -> int:
        """What a put that found the pool full evicts: the ``need`` bytes it waits for plus a slack of about
        ``urgent_eviction_slack`` objects, at most down to eviction_target (never the whole gap: the put
        waits for this eviction, while the background eviction catches up with the rest)."""
        _, used = self.allocatable_usage()
        held = self._shards.count_objects()
        slack = self._cfg.urgent_eviction_slack * math.ceil(used / held) if held else 0
        return max(need, min(self.default_eviction_bytes(), need + slack))

    def _has_headroom(self) -> bool:
        """The pool is used below halfway between eviction_high_watermark and full: the background eviction
        may hand the interpreter to waiting puts between its steps (past it, it runs flat out)."""
        capacity, used = self.allocatable_usage()
        used -= self.tiers.pending_bytes
        return used < capacity * (1.0 + self._cfg.eviction_high_watermark) / 2

    def default_eviction_bytes(self) -> int:
        """Bytes to free to get down to eviction_target (DRAM being demoted counts as free)."""
        capacity, used = self.allocatable_usage()
        used -= self.tiers.pending_bytes
        return max(0, math.ceil(used - self._cfg.eviction_target * capacity))

    def _candidate_limit(self, need: int, objects: int) -> int | None:
        """How many candidates phase 1 collects: sample_factor x (estimated victims); None = all.
        ``objects``: how many the shards held when the eviction began (counting them costs O(shards))."""
        factor = self._cfg.eviction_sample_factor
        if factor <= 0:
            return None
        used = sum([s.allocator.used for s in self._table.segments()])
        average = used / objects if objects else 1.0
        return factor * max(1, math.ceil(need / max(average, 1.0)))

    def _collect_candidates(self, now: float, limit: int | None, held: int) -> tuple[list[Candidate], int, bool]:
        """Phase 1: (candidates, objects examined, whether every object was examined), from the rotating
        shard cursor on. ``limit`` None = exact: every object of every shard, each shard once. Otherwise
        shards are visited until ``limit`` candidates are collected, each visit examining one window of at
        most ``SAMPLE_WINDOW`` objects that starts where that shard's previous window ended (so the work per
        candidate does not depend on how many objects a shard holds); a shard may be visited again, for its
        next window, until as many objects were examined as the shards hold (``held``)."""
        nshards = self._shards.num_shards
        budget = 0 if limit is None else held
        start = self._evict_cursor
        out: list[Candidate] = []
        scanned = examined = 0
        whole = True  # every visit so far saw its whole shard
        while True:
            if scanned >= nshards and (limit is None or len(out) >= limit or examined >= budget):
                break
            if scanned and scanned % nshards == 0 and not examined:
                break  # a whole pass over empty shards
            index = (start + scanned) % nshards
            scanned += 1
            seen, partial = self._visit(index, now, limit is not None, out)
            examined += seen
            whole = whole and not partial
            if limit is not None and (len(out) >= limit or examined >= budget):
                break
        self._evict_cursor = (start + scanned) % nshards
        return out, examined, whole and scanned >= nshards

    def _visit(self, index: int, now: float, windowed: bool, out: list[Candidate]) -> tuple[int, bool]:
        """Append shard ``index``'s candidates (its next window, or all of it): (objects examined, whether
        that was only part of the shard)."""
        allow_soft = self._cfg.allow_evict_soft_pinned
        tiers = self.tiers
        ssd = tiers.ssd_ids
        append = out.append
        shard = self._shards.shards[index]
        seen = first = 0
        with shard.lock:
            window: Iterable[tuple[str, ObjectMeta]] = shard.objects.items()
            if windowed:
                first = self._window_starts[index]
                if first >= len(shard.objects):
                    first = 0
                window = islice(window, first, first + SAMPLE_WINDOW)
            for key, meta in window:
                seen += 1
                if meta.flags & _EVICTABLE_MASK != COMPLETE or meta.lease_until > now:
                    continue
                extra = meta.extra
                if extra is None:
                    if not meta.flags & PRIMARY_COMPLETE or (ssd and meta.segment in ssd):
                        continue
                    count = 1
                else:
                    if not meta.all_replicas_complete():
                        continue
                    count = tiers.dram_count(meta) if ssd else 1 + len(extra)
                    if not count:
                        continue
                soft = meta.soft_pin_until > now
                if soft and not allow_soft:
                    continue
                append(_new_candidate(Candidate, (key, meta.last_access, meta.size * count, soft, meta.put_time)))
            if not windowed:
                return seen, False
            full_window = seen == SAMPLE_WINDOW
            self._window_starts[index] = first + seen if full_window else 0
        return seen, bool(first) or full_window

    def _evict_one(self, cand: Candidate, now: float, urgent: bool = False) -> tuple[int, bool]:
        """Phase 3 for one victim: (bytes freed, 0 if it no longer qualifies; whether the object is gone)."""
        if self.tiers.active:
            return self.tiers.evict_one(cand, now, urgent)

        def still_victim(meta: ObjectMeta) -> bool:
            return (
                meta.flags & _EVICTABLE_MASK == COMPLETE
                and meta.lease_until <= now
                and meta.last_access == cand.last_access
                and (cand.soft_pinned or meta.soft_pin_until <= now)
                and meta.all_replicas_complete()
            )

        meta = self._drop_if(cand.key, still_victim)
        return (0, False) if meta is None else (meta.size * meta.replica_count(), True)
