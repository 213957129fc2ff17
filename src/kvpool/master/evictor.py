"""The evictor: when the pool needs eviction, and the approximate-LRU mechanism that frees space.

``MasterState`` holds one ``Evictor`` and delegates ``needs_eviction`` and ``evict`` to it. It is a separate
object (composition, like ``TierManager``) because its state is its own: the eviction lock, the rotating shard
cursor and the policy. What it needs of the rest it is given: the shard map and segment table to scan, the tier
manager (demotion instead of dropping), ``drop_if`` (MasterState's re-validate-and-free of one key) and
``count_evicted`` (the state's counters). The policy that orders victims is eviction.py.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable

from kvpool.common.clock import Clock
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import Candidate, EvictionPolicy
from kvpool.master.objects import COMPLETE, HARD_PIN, PRIMARY_COMPLETE, ObjectMeta
from kvpool.master.segments import SegmentTable
from kvpool.master.shards import ShardMap
from kvpool.master.tiering import TierManager
from kvpool.master.types import EvictionReport

__all__ = ["MAX_EVICTION_ROUNDS", "Evictor"]

MAX_EVICTION_ROUNDS = 4
"""An eviction call samples again (from the next shards) while it has not freed enough, at most this often."""

_EVICTABLE_MASK = COMPLETE | HARD_PIN

DropIf = Callable[[str, Callable[[ObjectMeta], bool]], "ObjectMeta | None"]
"""MasterState._drop_if: under the key's stripe, unlink and free the object if the predicate holds."""


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

    def needs_eviction(self) -> bool:
        """used / capacity over the allocatable (OK) segments is above eviction_high_watermark."""
        capacity, used = self.allocatable_usage()
        used -= self.tiers.pending_bytes  # DRAM being demoted is as good as free
        return capacity > 0 and used > self._cfg.eviction_high_watermark * capacity

    def evict(self, bytes_to_free: int | None = None, urgent: bool = False) -> EvictionReport:
        """Approximate-LRU eviction of at least ``bytes_to_free`` bytes (default: down to eviction_target).

        Phase 1 samples candidates (COMPLETE, lease expired, not hard-pinned, no replica in flight) shard by
        shard from a rotating start, holding each shard lock only while copying that shard's candidates,
        until ``eviction_sample_factor`` x (estimated victims) are collected (factor 0 = every shard).
        Phase 2 asks the policy for victims, outside every lock. Phase 3 re-validates and frees each victim
        under its object stripe; one that was leased, touched, pinned or removed meanwhile is skipped.
        Soft-pinned objects are candidates only if allow_evict_soft_pinned (and the policy takes them last).
        With an SSD tier, a victim may be demoted instead of dropped (master/tiering.py): it counts towards
        the bytes freed but not as an eviction; ``urgent`` (a failed allocation) always frees at once.
        """
        started = time.perf_counter()
        with self._evict_lock:
            if bytes_to_free is None:
                bytes_to_free = self.default_eviction_bytes()
            objects = freed = scanned = gone_bytes = 0
            keys: list[str] = []
            nshards = self._shards.num_shards
            for _ in range(MAX_EVICTION_ROUNDS):
                need = bytes_to_free - freed
                if need <= 0 or (not urgent and self.tiers.active and self.tiers.saturated()):
                    break  # (the demotion backlog is full: victims would only be deferred)
                now = self._clock.monotonic()
                candidates, shards_scanned = self._collect_candidates(now, self._candidate_limit(need))
                scanned += len(candidates)
                if not candidates:
                    break
                by_key = {c.key: c for c in candidates}
                round_freed = skipped = 0
                for key in self._eviction.select(candidates, need):
                    cand = by_key.get(key)
                    if cand is None:
                        continue  # a policy bug; never evict what was not offered
                    got, gone = self._evict_one(cand, now, urgent)
                    if got:
                        round_freed += got
                        if gone:
                            objects += 1
                            gone_bytes += got
                            keys.append(key)
                    else:
                        skipped += 1
                freed += round_freed
                if shards_scanned >= nshards and not skipped and freed < bytes_to_free:
                    break  # a full scan: every evictable object was offered and taken
            if objects:
                self._count_evicted(objects, gone_bytes)
        return EvictionReport(objects, freed, scanned, time.perf_counter() - started, keys)

    def allocatable_usage(self) -> tuple[int, int]:
        """(capacity, used bytes) of the allocatable segments."""
        capacity = used = 0
        for seg in self._table.allocatable:
            capacity += seg.size
            used += seg.allocator.used
        return capacity, used

    def default_eviction_bytes(self) -> int:
        """Bytes to free to get down to eviction_target (DRAM being demoted counts as free)."""
        capacity, used = self.allocatable_usage()
        used -= self.tiers.pending_bytes
        return max(0, math.ceil(used - self._cfg.eviction_target * capacity))

    def _candidate_limit(self, need: int) -> int | None:
        """How many candidates phase 1 collects: sample_factor x (estimated victims); None = all."""
        factor = self._cfg.eviction_sample_factor
        if factor <= 0:
            return None
        objects = self._shards.count_objects()
        used = sum(s.allocator.used for s in self._table.segments())
        average = used / objects if objects else 1.0
        return factor * max(1, math.ceil(need / max(average, 1.0)))

    def _collect_candidates(self, now: float, limit: int | None) -> tuple[list[Candidate], int]:
        """Phase 1: (candidates, shards scanned), from the rotating cursor on."""
        allow_soft = self._cfg.allow_evict_soft_pinned
        tiers = self.tiers
        ssd = tiers.ssd_ids
        shards = self._shards.shards
        nshards = len(shards)
        start = self._evict_cursor
        out: list[Candidate] = []
        append = out.append
        scanned = 0
        while scanned < nshards:
            shard = shards[(start + scanned) % nshards]
            scanned += 1
            with shard.lock:
                for key, meta in shard.objects.items():
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
                    append(Candidate(key, meta.last_access, meta.size * count, soft, meta.put_time))
            if limit is not None and len(out) >= limit:
                break
        self._evict_cursor = (start + scanned) % nshards
        return out, scanned

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
