"""MasterState: the master's pure core. No sockets, no threads, no I/O; thread-safe with fine-grained locks.

The service layer calls it from an asyncio loop (put/get/exists/..., always batched) and a background thread
calls its periodic methods (``evict`` when ``needs_eviction()``, ``reclaim_abandoned_puts``,
``expire_stores``). Time comes from an injected ``Clock`` so tests run with a ManualClock and no sleeps.

Structure (mechanism here, policy elsewhere):

* ``ShardMap`` (shards.py): key -> ObjectMeta in N shards, each with its own lock; ``StripedLocks`` for
  multi-step operations on one key. Lock order is documented in shards.py and must be kept:
  membership | eviction lock -> object stripe -> shard lock(s) -> allocator | store free-queue.
* ``SegmentTable`` (segments.py): segments (allocator, secret, status) and stores (liveness, free queue).
* ``PlacementPolicy`` (placement.py) orders candidate segments; ``EvictionPolicy`` (eviction.py) orders
  victims. Both are pure and called outside every lock.

What this module holds: puts, reads, removal and pins. The other jobs of the state live next to it:
membership and suspicion (membership.py, a mixin), the evictor (evictor.py, an object this class holds and
delegates to), stats and invariants (reports.py, a mixin), and unlinking objects, freeing their ranges and
reclaiming abandoned puts (freeing.py, a mixin).

Semantics follow Mooncake Store's master with the differences docs/architecture.md (Master) states:
two-phase put (PROCESSING replicas are invisible), read leases block eviction and removal, approximate LRU
eviction above a watermark or on allocation failure, hard and soft pins, store heartbeats with expiry, and
stores as the source of truth (mount adopts the store's inventory).

Conventions of every batch call: one code per key, never an exception for a per-key failure; mismatched
list lengths give INVALID_ARGUMENT and more than ``max_batch`` keys give BATCH_TOO_LARGE for every key.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import cast

import xxhash

from kvpool.common import grants
from kvpool.common.clock import SYSTEM_CLOCK, Clock
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.groups import wrong_group
from kvpool.common.log import get_logger
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import EvictionPolicy, make_eviction
from kvpool.master.evictor import EvictionWork, Evictor
from kvpool.master.freeing import RECLAIM_GRACE_S, FreeingMixin, Range
from kvpool.master.membership import HEARTBEAT_FREED_LIMIT, MembershipMixin, _encode_key
from kvpool.master.objects import (
    COMPLETE,
    HARD_PIN,
    MAX_OFFSET,
    PRIMARY_COMPLETE,
    SEGMENT_SHIFT,
    ObjectMeta,
)
from kvpool.master.placement import PlacementPolicy, make_placement
from kvpool.master.quarantine import RangeQuarantine
from kvpool.master.reports import ReportsMixin
from kvpool.master.segments import SegmentStatus, SegmentTable
from kvpool.master.shards import ShardMap, StripedLocks
from kvpool.master.suspicion import StoreSuspicion
from kvpool.master.tiering import TierManager
from kvpool.master.types import (
    EvictionReport,
    GetResult,
    HeartbeatResult,
    InventoryItem,
    MasterStats,
    MountResult,
    PutOptions,
    PutStartResult,
    ReplicaGrant,
    SegmentReport,
    SegmentSpec,
)

# The dataclasses live in types.py and are re-exported here: callers may import them from either module.
__all__ = [
    "HEARTBEAT_FREED_LIMIT",
    "RECLAIM_GRACE_S",
    "EvictionReport",
    "GetResult",
    "HeartbeatResult",
    "InventoryItem",
    "MasterState",
    "MasterStats",
    "MountResult",
    "PutOptions",
    "PutStartResult",
    "ReplicaGrant",
    "SegmentReport",
    "SegmentSpec",
    "SegmentStatus",
]

_log = get_logger(__name__)


_U64 = 1 << 64
_SEG_SHIFT = SEGMENT_SHIFT  # packed extra replica: segment_id << 57 | offset << 1 | complete
_OFF_MASK = MAX_OFFSET
_EVICTABLE_MASK = COMPLETE | HARD_PIN
_SIZE_INTERN_LIMIT = 4096
_NO_EXCLUDE: set[int] = set()  # shared, never mutated (policies must not mutate ``exclude``)

_OK = ErrorCode.OK
_NOT_FOUND = ErrorCode.OBJECT_NOT_FOUND
_NOT_READY = ErrorCode.OBJECT_NOT_READY
_INVALID_KEY = ErrorCode.INVALID_KEY
_READ = grants.GrantOp.READ
_WRITE = grants.GrantOp.WRITE
_DEFAULT_PUT = PutOptions()
_by_offset = attrgetter("offset")


class _PutContext:
    """What one put_start batch computes once for all its keys."""

    __slots__ = ("now", "expiry_ms", "replica_num", "preferred", "writer_node", "flags", "soft_pin_until")

    def __init__(
        self,
        now: float,
        expiry_ms: int,
        replica_num: int,
        preferred: list[int],
        writer_node: str,
        flags: int,
        soft_pin_until: float,
    ) -> None:
        self.now = now
        self.expiry_ms = expiry_ms
        self.replica_num = replica_num
        self.preferred = preferred
        self.writer_node = writer_node
        self.flags = flags
        self.soft_pin_until = soft_pin_until


class MasterState(MembershipMixin, ReportsMixin, FreeingMixin):
    """The master's metadata, allocation, leases, eviction and membership; see the module docstring."""

    def __init__(
        self,
        config: MasterConfig,
        clock: Clock = SYSTEM_CLOCK,
        placement: PlacementPolicy | None = None,
        eviction: EvictionPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._cfg = config
        self._clock = clock
        self._rng = rng or random.Random()
        self._placement = placement or make_placement(config.placement, self._rng)
        self._eviction = eviction or make_eviction(config.eviction)
        self._shards = ShardMap(config.num_shards)
        self._stripes = StripedLocks()
        self._table = SegmentTable()
        self._membership = threading.Lock()
        self._stats_lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._evicted_bytes = 0
        self._puts = 0
        self._reclaimed = 0
        self._sizes: dict[int, int] = {}
        # Ranges of revoked puts, held until their WRITE grants are surely dead (master/quarantine.py).
        self._quarantine = RangeQuarantine()
        # Dead-store suspicion (master/suspicion.py): its rules; the service probes the stores.
        self._suspicion = StoreSuspicion(agreement=config.store_report_agreement)
        # SSD tier (master/tiering.py): inert until a store mounts a tier=1 segment.
        self.tiers = TierManager(
            config, clock, self._shards, self._stripes, self._table, self._free_ranges, self._quarantine.hold
        )
        # Eviction (master/evictor.py): needs_eviction and evict are delegated to it.
        self._evictor = Evictor(
            config,
            clock,
            self._shards,
            self._table,
            self.tiers,
            self._eviction,
            self._drop_if,
            self._count_evicted,
            self._rng,
        )
        # Listener of objects that became readable / were dropped: (stored keys, removed keys). Called
        # outside the shard locks; it must not block (master/kv_events.py only enqueues).
        self.on_change: Callable[[Sequence[str], Sequence[str]], None] | None = None

    @property
    def config(self) -> MasterConfig:
        return self._cfg

    # =================================================================== puts

    def put_start(
        self, client_id: str, keys: Sequence[str], sizes: Sequence[int], options: PutOptions = _DEFAULT_PUT
    ) -> list[PutStartResult]:
        """Allocate space for each new object (PROCESSING, invisible) and return WRITE grants.

        Per key: INVALID_KEY / KEY_TOO_LONG; size 0 or not a positive int -> INVALID_ARGUMENT (empty values
        are not stored: a cache gains nothing from them and a zero-length range cannot be granted);
        size > max_object_bytes -> VALUE_TOO_LARGE; a COMPLETE object -> OBJECT_ALREADY_EXISTS (values are
        immutable; clients treat it as success); an unfinished put (anyone's) younger than put_timeout_s ->
        OBJECT_NOT_READY, an older one is reclaimed and this put proceeds. Replicas go to ``replica_num``
        distinct OK segments in the placement policy's order, best effort (>= 1 is OK). If none fits, one
        synchronous eviction runs for the batch and those keys are retried once; then NO_SPACE.
        """
        n = len(keys)
        bad = self._batch_error(n, len(sizes))
        if bad is None and (
            type(options.replica_num) is not int
            or options.replica_num < 0
            or not isinstance(client_id, str)
            or not client_id
        ):
            bad = ErrorCode.INVALID_ARGUMENT
        if bad is not None:
            return [PutStartResult(bad) for _ in range(n)]
        ctx = self._put_context(options)
        results: list[PutStartResult | None] = [self._put_one(client_id, keys[i], sizes[i], ctx) for i in range(n)]
        # Evicting cannot help an object larger than every allocatable segment.
        largest = max((s.size for s in self._table.allocatable), default=0)
        retry = [i for i in range(n) if results[i] is None and sizes[i] <= largest]
        if retry and self.tiers.active:
            retry = self._wait_for_demotions(client_id, keys, sizes, ctx, results, retry)
        if retry:
            need = sum(sizes[i] for i in retry)
            self.evict(self._evictor.urgent_eviction_bytes(need), urgent=True)
            for i in retry:
                results[i] = self._put_one(client_id, keys[i], sizes[i], ctx)
        return [r if r is not None else PutStartResult(ErrorCode.NO_SPACE) for r in results]

    def _wait_for_demotions(
        self,
        client_id: str,
        keys: Sequence[str],
        sizes: Sequence[int],
        ctx: _PutContext,
        results: list[PutStartResult | None],
        retry: list[int],
    ) -> list[int]:
        """SSD tier backpressure (docs/ssd-tier.md): rather than drop objects to fit a put, queue demotions
        and refuse the put with DEMOTION_BACKLOG (the client retries) while demotions in flight will free
        DRAM. Returns the keys left for the urgent eviction (none while a backlog is draining)."""
        self.evict(max(sum(sizes[i] for i in retry), self._default_eviction_bytes()))
        for i in retry:
            results[i] = self._put_one(client_id, keys[i], sizes[i], ctx)
        retry = [i for i in retry if results[i] is None]
        if retry and self.tiers.backpressure(len(retry)):
            for i in retry:
                results[i] = PutStartResult(ErrorCode.DEMOTION_BACKLOG)
            return []
        return retry

    def put_end(self, client_id: str, keys: Sequence[str], checksums: Sequence[int]) -> list[ErrorCode]:
        """Make objects visible: replicas COMPLETE, checksum recorded, LRU position = now.

        Unknown key -> OBJECT_NOT_FOUND (e.g. reclaimed); already COMPLETE -> OK (idempotent); another
        client's put -> ILLEGAL_CLIENT; checksum not a uint64 -> INVALID_ARGUMENT.
        """
        n = len(keys)
        bad = self._batch_error(n, len(checksums))
        if bad is not None:
            return [bad] * n
        now = self._clock.monotonic()
        shards = self._shards.shards
        nshards = len(shards)
        codes: list[ErrorCode] = []
        done = 0
        listener = self.on_change
        visible: list[str] = []
        for key, checksum in zip(keys, checksums, strict=True):
            try:
                kb = key.encode()
            except (AttributeError, UnicodeEncodeError):
                codes.append(_INVALID_KEY)
                continue
            if type(checksum) is not int or not 0 <= checksum < _U64:
                codes.append(ErrorCode.INVALID_ARGUMENT)
                continue
            shard = shards[xxhash.xxh3_64_intdigest(kb) % nshards]
            with shard.lock:
                meta = shard.objects.get(key)
                if meta is None:
                    code = _NOT_FOUND
                elif meta.flags & COMPLETE:
                    code = _OK
                elif shard.processing.get(key) != client_id:
                    code = ErrorCode.ILLEGAL_CLIENT
                else:
                    meta.mark_all_complete()
                    meta.checksum = checksum
                    if meta.soft_pin_until:
                        # The soft pin's deadline starts when the object becomes readable.
                        meta.soft_pin_until += now - meta.put_time
                    meta.last_access = now
                    meta.put_time = now
                    del shard.processing[key]
                    done += 1
                    code = _OK
                    if listener is not None:
                        visible.append(key)
            codes.append(code)
        if visible and listener is not None:
            listener(visible, ())
        if done:
            with self._stats_lock:
                self._puts += done
        return codes

    def put_revoke(self, client_id: str, keys: Sequence[str]) -> list[ErrorCode]:
        """Abandon unfinished puts and free their ranges (the writer's transfer failed).

        Unknown -> OBJECT_NOT_FOUND; already COMPLETE -> NO_PUT_IN_PROGRESS (a visible object is removed
        with remove(), never revoked); another client's put -> ILLEGAL_CLIENT.
        """
        bad = self._batch_error(len(keys), len(keys))
        if bad is not None:
            return [bad] * len(keys)
        codes: list[ErrorCode] = []
        for key in keys:
            shard = self._shard_or_none(key)
            if shard is None:
                codes.append(_INVALID_KEY)
                continue
            ranges: list[Range] = []
            with self._stripes.lock_for(key):
                with shard.lock:
                    meta = shard.objects.get(key)
                    if meta is None:
                        code = _NOT_FOUND
                    elif meta.flags & COMPLETE:
                        code = ErrorCode.NO_PUT_IN_PROGRESS
                    elif shard.processing.get(key) != client_id:
                        code = ErrorCode.ILLEGAL_CLIENT
                    else:
                        del shard.objects[key]
                        del shard.processing[key]
                        ranges = self._ranges_of(meta)
                        code = _OK
                        # Late WRITE bytes of this put may still land: the ranges are reused only once
                        # its grant has expired (master/quarantine.py), like an abandoned put's.
                        self._quarantine.hold(meta.put_time + self._cfg.put_timeout_s + RECLAIM_GRACE_S, ranges, key)
            codes.append(code)
        return codes

    # =================================================================== reads

    def get_replicas(self, keys: Sequence[str], grant_lease: bool = True) -> list[GetResult]:
        """Descriptors and READ grants of readable objects; grants or extends their read lease.

        Readable = COMPLETE with >= 1 COMPLETE replica on a live (OK or DRAINING) segment. The lease becomes
        ``max(lease, now + lease_ttl_s)`` and the grants expire with it; last_access is touched; hits and
        misses are counted. Not found -> OBJECT_NOT_FOUND; PROCESSING -> OBJECT_NOT_READY.
        ``grant_lease=False`` (admin view): no lease, no LRU touch, no hit/miss counting; the grants still
        expire after lease_ttl_s but the object is not protected meanwhile (readers verify the checksum).
        """
        if len(keys) > self._cfg.max_batch:
            return [GetResult(ErrorCode.BATCH_TOO_LARGE) for _ in keys]
        clock = self._clock
        now = clock.monotonic()
        wall_offset_ms = clock.wall_ms() - now * 1000.0
        new_lease = now + self._cfg.lease_ttl_s
        no_lease_expiry_ms = int(new_lease * 1000.0 + wall_offset_ms)
        by_id = self._table.by_id
        shards = self._shards.shards
        nshards = len(shards)
        digest = xxhash.xxh3_64_intdigest
        out: list[GetResult] = []
        append = out.append
        hits = 0
        # Reads served only by SSD replicas count towards promotion (leased reads only).
        ssd_hits: list[str] | None = [] if grant_lease and self.tiers.active else None
        ssd_bytes = 0
        max_key = self._cfg.max_key_bytes
        for key in keys:
            try:
                kb = key.encode()
            except (AttributeError, UnicodeEncodeError):
                append(GetResult(_INVALID_KEY))
                continue
            if len(kb) > max_key:  # can never exist: say why, not just "not found"
                append(GetResult(ErrorCode.KEY_TOO_LONG))
                continue
            shard = shards[digest(kb) % nshards]
            live: list[Range] | None = None
            with shard.lock:
                meta = shard.objects.get(key)
                if meta is None:
                    code = _NOT_FOUND
                elif not meta.flags & COMPLETE:
                    code = _NOT_READY
                else:
                    if meta.flags & PRIMARY_COMPLETE:
                        seg = by_id.get(meta.segment)
                        if seg is not None and seg.readable:
                            live = [(seg, meta.offset)]
                    extra = meta.extra
                    if extra is not None:
                        for r in extra:
                            seg = by_id.get(r >> _SEG_SHIFT)
                            if seg is not None and seg.readable and r & 1:
                                if live is None:
                                    live = []
                                live.append((seg, (r >> 1) & _OFF_MASK))
                    if live is not None:
                        code = _OK
                        if grant_lease:
                            lease_until = meta.extend_lease(new_lease)
                            meta.last_access = now
                        else:
                            lease_until = meta.lease_until
                        size = meta.size
                        checksum = meta.checksum
                    else:
                        code = _NOT_FOUND
            if live is None:
                append(GetResult(code))
                continue
            hits += 1
            if ssd_hits is not None and all(seg.tier for seg, _ in live):
                ssd_hits.append(key)
                ssd_bytes += size
            expiry_ms = int(lease_until * 1000.0 + wall_offset_ms) if grant_lease else no_lease_expiry_ms
            descs = tuple(
                [
                    ReplicaGrant(
                        seg.id,
                        seg.node,
                        seg.tcp_endpoint,
                        seg.shm_path,
                        off,
                        size,
                        expiry_ms,
                        seg.sign(_READ, off, size, expiry_ms, kb),
                        seg.tier,
                    )
                    for seg, off in live
                ]
            )
            append(GetResult(_OK, size, checksum, expiry_ms, descs))
        if ssd_hits:
            self.tiers.note_hits(ssd_hits, ssd_bytes)
        if grant_lease:
            with self._stats_lock:
                self._hits += hits
                self._misses += len(keys) - hits
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is readable now; touches last_access of hits; grants no lease.
        More than max_batch keys raises KvPoolError(BATCH_TOO_LARGE) (there is no per-key code to return)."""
        self._check_batch(len(keys))
        out: list[bool] = []
        self._scan_readable(keys, out, stop_at_miss=False)
        return out

    def prefix_length(self, keys: Sequence[str]) -> int:
        """How many leading keys are readable (stops at the first miss); touches hits; no lease.
        More than max_batch keys raises KvPoolError(BATCH_TOO_LARGE)."""
        self._check_batch(len(keys))
        out: list[bool] = []
        self._scan_readable(keys, out, stop_at_miss=True)
        return len(out) - (1 if out and not out[-1] else 0)

    # =================================================================== removal and pins

    def remove(self, keys: Sequence[str], force: bool = False) -> list[ErrorCode]:
        """Remove objects. PROCESSING (or a replica in flight) -> OBJECT_NOT_READY even with force;
        leased -> OBJECT_HAS_LEASE and hard-pinned -> OBJECT_PINNED unless ``force``."""
        bad = self._batch_error(len(keys), len(keys))
        if bad is not None:
            return [bad] * len(keys)
        codes: list[ErrorCode] = []
        for key in keys:
            now = self._clock.monotonic()
            outcome: list[ErrorCode] = []

            def removable(meta: ObjectMeta, _out: list[ErrorCode] = outcome, _now: float = now) -> bool:
                if not meta.flags & COMPLETE or not meta.all_replicas_complete():
                    _out.append(_NOT_READY)
                elif not force and meta.lease_until > _now:
                    _out.append(ErrorCode.OBJECT_HAS_LEASE)
                elif not force and meta.flags & HARD_PIN:
                    _out.append(ErrorCode.OBJECT_PINNED)
                else:
                    return True
                return False

            dropped = self._drop_if(key, removable)
            codes.append(_OK if dropped is not None else (outcome[0] if outcome else _NOT_FOUND))
        return codes

    def remove_all(self, force: bool = False, prefix: str = "") -> int:
        """Remove every visible object whose key starts with ``prefix``; leased and hard-pinned objects
        only with ``force``; unfinished puts never. Returns how many were removed."""
        removed = 0
        for shard in self._shards:
            now = self._clock.monotonic()

            def removable(meta: ObjectMeta, _now: float = now) -> bool:
                return (
                    bool(meta.flags & COMPLETE)
                    and meta.all_replicas_complete()
                    and (force or (meta.lease_until <= _now and not meta.flags & HARD_PIN))
                )

            with shard.lock:
                keys = [k for k, m in shard.objects.items() if k.startswith(prefix) and removable(m)]
            for key in keys:
                if self._drop_if(key, removable, shard) is not None:
                    removed += 1
        return removed

    def pin(
        self, keys: Sequence[str], hard: bool = False, soft_ttl_s: float = 0.0, unpin: bool = False
    ) -> list[ErrorCode]:
        """Hard pin (never evicted) or soft pin for ``soft_ttl_s`` (0 = config.soft_pin_ttl_s; evicted
        last), or remove that kind of pin with ``unpin``. Unknown key -> OBJECT_NOT_FOUND."""
        bad = self._batch_error(len(keys), len(keys))
        if bad is None and (not isinstance(soft_ttl_s, int | float) or soft_ttl_s < 0):
            bad = ErrorCode.INVALID_ARGUMENT
        if bad is not None:
            return [bad] * len(keys)
        now = self._clock.monotonic()
        deadline = now + (soft_ttl_s or self._cfg.soft_pin_ttl_s)
        codes: list[ErrorCode] = []
        for key in keys:
            shard = self._shard_or_none(key)
            if shard is None:
                codes.append(_INVALID_KEY)
                continue
            with shard.lock:
                meta = shard.objects.get(key)
                if meta is None:
                    codes.append(_NOT_FOUND)
                    continue
                if hard:
                    meta.flags = meta.flags & ~HARD_PIN if unpin else meta.flags | HARD_PIN
                elif unpin:
                    meta.soft_pin_until = 0.0
                elif meta.soft_pin_until < deadline:
                    meta.soft_pin_until = deadline
            codes.append(_OK)
        return codes

    # =================================================================== periodic

    def needs_eviction(self) -> bool:
        """used / capacity over the allocatable (OK) segments is above eviction_high_watermark."""
        return self._evictor.needs_eviction()

    def evict(self, bytes_to_free: int | None = None, urgent: bool = False) -> EvictionReport:
        """Approximate-LRU eviction of at least ``bytes_to_free`` bytes (default: down to eviction_target);
        master/evictor.py has how."""
        return self._evictor.evict(bytes_to_free, urgent)

    def eviction_work(self) -> EvictionWork:
        """Eviction calls, objects examined and evicted, and seconds spent since the start (benchmarks)."""
        return self._evictor.work()

    def _count_evicted(self, objects: int, nbytes: int) -> None:
        with self._stats_lock:
            self._evictions += objects
            self._evicted_bytes += nbytes

    def _allocatable_usage(self) -> tuple[int, int]:
        return self._evictor.allocatable_usage()

    def _default_eviction_bytes(self) -> int:
        return self._evictor.default_eviction_bytes()

    # =================================================================== internals: puts

    def _put_context(self, options: PutOptions) -> _PutContext:
        cfg = self._cfg
        now = self._clock.monotonic()
        soft = options.soft_pin_ttl_s
        return _PutContext(
            now=now,
            expiry_ms=self._clock.wall_ms() + int(cfg.put_timeout_s * 1000),
            replica_num=options.replica_num or cfg.default_replica_num,
            preferred=self._preferred_ids(options),
            writer_node=options.writer_node,
            flags=HARD_PIN if options.hard_pin else 0,
            soft_pin_until=now + soft if soft and soft > 0 else 0.0,
        )

    def _preferred_ids(self, options: PutOptions) -> list[int]:
        """Resolve preferred segments (ids, decimal ids or node names) and the preferred node to ids."""
        if not options.preferred_segments and not options.preferred_node:
            return []
        allocatable = self._table.allocatable
        out: list[int] = []
        names = list(options.preferred_segments)
        if options.preferred_node:
            names.append(options.preferred_node)
        for item in names:
            if isinstance(item, int):
                out.append(item)
            elif isinstance(item, str):
                if item.isdigit() and int(item) in self._table.by_id:
                    out.append(int(item))
                else:
                    out.extend(s.id for s in allocatable if s.node == item)
        return out

    def _put_one(self, client_id: str, key: str, size: int, ctx: _PutContext) -> PutStartResult | None:
        """One key of put_start; None when no segment could fit it (the caller evicts and retries)."""
        cfg = self._cfg
        kb = _encode_key(key, cfg.max_key_bytes)
        if not isinstance(kb, bytes):
            return PutStartResult(kb)
        if type(size) is not int or size <= 0:
            return PutStartResult(ErrorCode.INVALID_ARGUMENT)
        if size > cfg.max_object_bytes:
            return PutStartResult(ErrorCode.VALUE_TOO_LARGE)
        shard = self._shards.shard_of(kb)
        with self._stripes.lock_for(key):
            stale: list[Range] = []
            with shard.lock:
                meta = shard.objects.get(key)
                if meta is not None:
                    if meta.flags & COMPLETE:
                        return PutStartResult(ErrorCode.OBJECT_ALREADY_EXISTS)
                    if ctx.now - meta.put_time < cfg.put_timeout_s:
                        return PutStartResult(_NOT_READY)
                    # An abandoned put: its writer's grant has expired; take the key over.
                    del shard.objects[key]
                    shard.processing.pop(key, None)
                    stale = self._ranges_of(meta)
            if meta is not None:
                self._free_ranges(stale, key)
                with self._stats_lock:
                    self._reclaimed += 1
            placed = self._allocate(key, size, ctx)
            if not placed:
                return None
            size = self._intern_size(size)
            with shard.lock:
                for s, _ in placed:
                    if s.removed:
                        # A segment was unmounted while we allocated on it (its allocator went with it).
                        placed = [(s, off) for s, off in placed if not s.removed]
                        if not placed:
                            return None
                        break
                first, first_offset = placed[0]
                meta = ObjectMeta(size, first.id, first_offset, ctx.now, ctx.flags, 0, ctx.soft_pin_until)
                if len(placed) > 1:
                    for s, off in placed[1:]:
                        meta.add_replica(s.id, off, False)
                shard.objects[key] = meta
                shard.processing[key] = client_id
        expiry_ms = ctx.expiry_ms
        if len(placed) == 1:
            return PutStartResult(
                _OK,
                (
                    ReplicaGrant(
                        first.id,
                        first.node,
                        first.tcp_endpoint,
                        first.shm_path,
                        first_offset,
                        size,
                        expiry_ms,
                        first.sign(_WRITE, first_offset, size, expiry_ms, kb),
                    ),
                ),
            )
        return PutStartResult(
            _OK,
            tuple(
                ReplicaGrant(
                    s.id,
                    s.node,
                    s.tcp_endpoint,
                    s.shm_path,
                    off,
                    size,
                    expiry_ms,
                    s.sign(_WRITE, off, size, expiry_ms, kb),
                )
                for s, off in placed
            ),
        )

    def _intern_size(self, size: int) -> int:
        # Objects of one page size share one int (sizes arrive as fresh ints from the wire).
        interned = self._sizes.get(size)
        if interned is not None:
            return interned
        if len(self._sizes) < _SIZE_INTERN_LIMIT:
            self._sizes[size] = size
        return size

    def _allocate(self, key: str, size: int, ctx: _PutContext) -> list[Range]:
        """Try the policy's candidates in order until ``replica_num`` distinct segments hold the object."""
        segments = self._table.allocatable
        if not segments:
            return []
        order = self._placement.choose(segments, size, ctx.replica_num, _NO_EXCLUDE, ctx.preferred, ctx.writer_node)
        by_id = self._table.by_id
        want = ctx.replica_num
        placed: list[Range] = []
        for segment_id in order:
            seg = by_id.get(segment_id)
            if seg is None or seg.status != SegmentStatus.OK:
                continue
            if want > 1 and any(s is seg for s, _ in placed):
                continue  # a policy returned a duplicate: replicas go to distinct segments
            offset = seg.allocate_for(key, size)
            if offset is None:
                continue
            placed.append((seg, offset))
            if len(placed) >= want:
                break
        return placed

    # =================================================================== internals: reads

    def _scan_readable(self, keys: Sequence[str], out: list[bool], stop_at_miss: bool) -> None:
        """exists()/prefix_length(): append readability per key, touching hits.

        Lock-free on purpose: an exists answer is a snapshot that may be stale the moment it is sent, so
        it needs no more consistency than one dict lookup gives (atomic under the GIL), and a racing
        writer can only make it answer as of just before or just after its change. Skipping the shard
        lock is a quarter of the cost of a 1,000-key prefix lookup. Nothing here writes shared state but
        ``last_access`` (a plain store; a lost update only makes a hit look a little older)."""
        now = self._clock.monotonic()
        by_id = self._table.by_id
        append = out.append
        keys = keys if type(keys) is list else list(keys)
        cfg = self._cfg
        if cfg.groups > 1:  # every key's group is checked in the same pass (decision 0080)
            found = self._shards.lookup_many_in_group(keys, cfg.groups, cfg.group)
            if type(found) is int:
                raise wrong_group(keys[found], cfg.groups, cfg.group)
            metas = cast("list[ObjectMeta | None]", found)
        else:
            metas = self._shards.lookup_many(keys)
        for meta in metas:
            ok = False
            if meta is not None and meta.flags & COMPLETE:
                if meta.flags & PRIMARY_COMPLETE:
                    seg = by_id.get(meta.segment)
                    ok = seg is not None and seg.readable
                if not ok and meta.extra is not None:
                    for r in meta.extra:
                        seg = by_id.get(r >> _SEG_SHIFT)
                        if seg is not None and seg.readable and r & 1:
                            ok = True
                            break
                if ok:
                    meta.last_access = now
            append(ok)
            if stop_at_miss and not ok:
                return

    # =================================================================== internals: misc

    def _check_batch(self, n: int) -> None:
        if n > self._cfg.max_batch:
            raise KvPoolError(ErrorCode.BATCH_TOO_LARGE, f"{n} keys > max_batch={self._cfg.max_batch}")

    def _batch_error(self, n: int, m: int) -> ErrorCode | None:
        if n != m:
            return ErrorCode.INVALID_ARGUMENT
        if n > self._cfg.max_batch:
            return ErrorCode.BATCH_TOO_LARGE
        return None
