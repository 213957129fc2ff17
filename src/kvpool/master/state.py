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

Semantics follow Mooncake Store's master with the differences docs/architecture.md (Master) states:
two-phase put (PROCESSING replicas are invisible), read leases block eviction and removal, approximate LRU
eviction above a watermark or on allocation failure, hard and soft pins, store heartbeats with expiry, and
stores as the source of truth (mount adopts the store's inventory).

Conventions of every batch call: one code per key, never an exception for a per-key failure; mismatched
list lengths give INVALID_ARGUMENT and more than ``max_batch`` keys give BATCH_TOO_LARGE for every key.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter

import xxhash

from kvpool.common import grants
from kvpool.common.clock import SYSTEM_CLOCK, Clock
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import Candidate, EvictionPolicy, make_eviction
from kvpool.master.objects import (
    COMPLETE,
    HARD_PIN,
    MAX_OFFSET,
    PRIMARY_COMPLETE,
    SEGMENT_SHIFT,
    ObjectMeta,
    ReplicaStatus,
)
from kvpool.master.placement import PlacementPolicy, make_placement
from kvpool.master.quarantine import RangeQuarantine
from kvpool.master.segments import Segment, SegmentInfo, SegmentStatus, SegmentTable, StoreEntry
from kvpool.master.shards import Shard, ShardMap, StripedLocks, shard_index
from kvpool.master.suspicion import StoreSuspicion, SuspicionReport, Verdict
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

RECLAIM_GRACE_S = 5.0
"""Extra wait before the periodic reclaim reuses an abandoned put's ranges: the writer's WRITE grant
(expiry = put_start + put_timeout_s) has then surely expired on the store, even with some clock skew."""
HEARTBEAT_FREED_LIMIT = 10_000
"""Most free notifications one heartbeat reply carries."""
MAX_EVICTION_ROUNDS = 4
"""An eviction call samples again (from the next shards) while it has not freed enough, at most this often."""

_U64 = 1 << 64
_SEG_SHIFT = SEGMENT_SHIFT  # packed extra replica: segment_id << 57 | offset << 1 | complete
_OFF_MASK = MAX_OFFSET
_EVICTABLE_MASK = COMPLETE | HARD_PIN
_READABLE_MASK = COMPLETE | PRIMARY_COMPLETE
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

Range = tuple[Segment, int]
"""(segment, offset) of one allocated block."""


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


class MasterState:
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
        self._evict_lock = threading.Lock()
        self._evict_cursor = self._rng.randrange(config.num_shards)
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
        # Listener of objects that became readable / were dropped: (stored keys, removed keys). Called
        # outside the shard locks; it must not block (master/kv_events.py only enqueues).
        self.on_change: Callable[[Sequence[str], Sequence[str]], None] | None = None

    @property
    def config(self) -> MasterConfig:
        return self._cfg

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
            self.evict(max(need, self._default_eviction_bytes()), urgent=True)
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
                            if meta.lease_until < new_lease:
                                meta.lease_until = new_lease
                            meta.last_access = now
                        size = meta.size
                        checksum = meta.checksum
                        lease_until = meta.lease_until
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

    def needs_eviction(self) -> bool:
        """used / capacity over the allocatable (OK) segments is above eviction_high_watermark."""
        capacity, used = self._allocatable_usage()
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
                bytes_to_free = self._default_eviction_bytes()
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
                with self._stats_lock:
                    self._evictions += objects
                    self._evicted_bytes += gone_bytes
        return EvictionReport(objects, freed, scanned, time.perf_counter() - started, keys)

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
            placed = self._allocate(size, ctx)
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

    def _allocate(self, size: int, ctx: _PutContext) -> list[Range]:
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
            offset = seg.allocator.allocate(size)
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
        for meta in self._shards.lookup_many(keys if type(keys) is list else list(keys)):
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

    # =================================================================== internals: eviction

    def _allocatable_usage(self) -> tuple[int, int]:
        capacity = used = 0
        for seg in self._table.allocatable:
            capacity += seg.size
            used += seg.allocator.used
        return capacity, used

    def _default_eviction_bytes(self) -> int:
        capacity, used = self._allocatable_usage()
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
