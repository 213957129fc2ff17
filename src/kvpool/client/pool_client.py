"""PoolClient: the batch API an engine calls (close to Mooncake's Python store API, so engines port).

Return conventions (Mooncake's, so ported code keeps its checks): ``put``-style calls return 0 or a
negative :class:`~kvpool.common.errors.ErrorCode`; ``get_into``-style calls return the bytes read or a
negative code; batch calls return one int per key, in order. Whole-call failures that are the caller's
fault (mismatched list lengths) raise ``KvPoolError``; an unreachable master gives per-key UNAVAILABLE
(or misses for lookups) within the call's deadline: inference goes on.

Every read is verified against the object's checksum and discarded if it completed after its lease.
The client is thread-safe.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar, cast

from kvpool.client.batching import split_batches
from kvpool.client.config import ClientConfig
from kvpool.client.group_router import GroupRouter, connect_master
from kvpool.client.lease_cache import LeaseCache, LeaseRenewer
from kvpool.client.master_client import MasterClient
from kvpool.client.read_by_key import SpeculativeReads
from kvpool.client.store_failures import StoreFailureReporter
from kvpool.client.unanswered_puts import UnansweredPuts
from kvpool.common import envs
from kvpool.common.auth import load_token
from kvpool.common.checksum import LazyChecksum
from kvpool.common.clock import SYSTEM_CLOCK, Clock, Deadline
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.failpoints import CLIENT_PUT_BEFORE_END, failpoint
from kvpool.common.grants import GrantOp
from kvpool.common.groups import group_of
from kvpool.common.log import get_logger, log_once
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.transfer.base import Replica, TransferRequest, replica_of
from kvpool.transfer.registry import TransportSet

R = TypeVar("R")

_FIRST_MAPPABLE_ADDRESS = 4096
"""Linux never maps the first page (vm.mmap_min_addr is at least this): a pointer below it is NULL plus a bit."""

log = get_logger(__name__)

Buffer = Any  # anything that exports the buffer protocol (bytes, bytearray, memoryview, numpy, torch.numpy())

# The largest per-thread landing buffer of batch_get kept between calls (every thread that calls get keeps
# one: an engine's thread pool must not hold gigabytes); a larger call allocates a buffer of its own.
_SCRATCH_KEEP = 16 << 20
_SPECULATIVE_BATCH_PART = 256 << 10
"""A batch is read by key while the master answers (decision 0031) only when every buffer is at most this
long: small pages, which one connection moves as fast as the striped lanes would."""

# How long a store whose replica did not answer within its share of a read's deadline is read last.
_SUSPECT_S = 5.0

# Codes a put maps to success: the value is immutable and already there (or on its way).
_PUT_OK = {ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.OBJECT_NOT_READY}
_REVOKE_TIMEOUT_S = 1.0
"""Deadline of the revoke that follows an unanswered BatchPutStart (the put's own deadline has passed)."""
BACKLOG_FIRST_PAUSE_S = 0.001
BACKLOG_MAX_PAUSE_S = 0.01
"""Pauses before asking again for keys refused with DEMOTION_BACKLOG (PoolClient._start_puts)."""


@dataclass(frozen=True)
class PutConfig:
    """Per-call placement options (Mooncake's ReplicateConfig)."""

    replica_num: int = 0
    hard_pin: bool = False
    soft_pin_ttl_s: float = 0.0
    preferred_segments: tuple[str, ...] = ()
    preferred_node: str = ""

    def to_proto(self, default_replicas: int, node: str) -> pb.PutConfig:
        return pb.PutConfig(
            replica_num=self.replica_num or default_replicas,
            hard_pin=self.hard_pin,
            soft_pin_ttl_ms=int(self.soft_pin_ttl_s * 1000),
            preferred_segments=list(self.preferred_segments),
            preferred_node=self.preferred_node,
            writer_node=node,
        )


def ptr_view(ptr: int, size: int) -> memoryview:
    """A writable memoryview over raw memory (SGLang's host pool hands out pointers). Like any raw-pointer
    API it trusts the caller that [ptr, ptr + size) is mapped; a NULL (first-page) pointer or a negative
    size, the usual mistakes, are refused instead of faulting."""
    if size < 0 or (size and ptr < _FIRST_MAPPABLE_ADDRESS):
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"bad buffer: pointer 0x{ptr:x}, {size} bytes")
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def _local_cluster_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The master (and token file) of the running local cluster, if there is one (common/local_context.py)."""
    from kvpool.common import local_context

    context = local_context.current()
    if context is None:
        return {}
    log_once(log, logging.WARNING, f"local:{context.master}", "KVPOOL_MASTER is not set: %s", context.describe())
    return {"master": context.master, "token_file": settings["token_file"] or context.token_file}


def _keyed(request_type: Callable[..., R], keys: Sequence[str], **fields: Any) -> R:
    """A master request carrying ``keys``. A str that is not valid UTF-8 (a lone surrogate, as
    ``os.fsdecode`` makes of undecodable bytes) cannot go into a request at all; it goes as "", which the
    master refuses with INVALID_KEY (or does not hold) as it does any other malformed key. Checked only
    when building the request failed: the common case pays nothing."""
    try:
        return request_type(keys=list(keys), **fields)
    except UnicodeEncodeError:
        return request_type(keys=[key if _is_utf8(key) else "" for key in keys], **fields)


def _is_utf8(key: str) -> bool:
    try:
        key.encode()
    except UnicodeEncodeError:
        return False
    return True


def _byte_view(buf: Buffer, writable: bool) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1 or not view.contiguous:
        view = view.cast("B") if view.contiguous else memoryview(bytes(view))
    if writable and view.readonly:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "destination buffer is read-only")
    return view


class _Counters:
    """What the client did, for an engine to publish (``PoolClient.metrics()``)."""

    FIELDS = (
        "puts",
        "put_bytes",
        "put_errors",
        "gets",
        "get_bytes",
        "get_misses",
        "get_errors",
        "checksum_mismatches",
        "lease_expired",
        "lease_cache_hits",
        "lease_renewals",
        "revalidated_reads",
        "revalidations_refused",
        "lookups",
        "lookup_hits",
        "degraded_calls",
        "put_backlog_retries",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(self.FIELDS, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


class PoolClient:
    """A thread-safe handle on the pool. ``PoolClient("host:port")`` or ``PoolClient.from_env()``."""

    def __init__(
        self,
        master: str | None = None,
        *,
        config: ClientConfig | None = None,
        transports: TransportSet | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        cfg = config or ClientConfig()
        if master:
            cfg.master = master
        self.config = cfg
        self.client_id = uuid.uuid4().hex
        self.node = envs.node_name()
        self._clock = clock
        # One MasterClient, or a GroupRouter over the cluster's shard groups (decision 0080).
        self._master: MasterClient | GroupRouter = connect_master(cfg)
        self.groups = self._master.groups if isinstance(self._master, GroupRouter) else 1
        self._transports = transports or TransportSet.default(cfg, self.node)
        self._counters = _Counters()
        self._unanswered = UnansweredPuts()
        self._renewer = LeaseRenewer(self._renew_leases) if cfg.lease_renewal and cfg.lease_cache_entries else None
        self._leases = LeaseCache(
            cfg.lease_cache_entries,
            clock,
            on_renewal_due=self._renewer.request if self._renewer else None,
            keep_hints=cfg.revalidate_reads and self._renewer is not None,
        )
        self._suspects: dict[str, float] = {}  # tcp endpoint -> monotonic time its suspicion ends
        self._suspects_lock = threading.Lock()
        self._scratch = threading.local()  # each thread's landing buffer of batch_get
        self._speculation = SpeculativeReads(cfg.speculative_read_bytes, clock, load_token(cfg.token_file))
        self._store_failures = StoreFailureReporter(self._report_store_failures)
        self._closed = False

    @classmethod
    def from_env(cls, **overrides: Any) -> PoolClient:
        """A client configured from KVPOOL_* variables (KVPOOL_MASTER, KVPOOL_TOKEN_FILE, ...); without
        KVPOOL_MASTER, the running ``kvpool local up`` cluster (logged once)."""
        settings: dict[str, Any] = {
            "master": envs.KVPOOL_MASTER.get(),
            "token_file": envs.KVPOOL_TOKEN_FILE.get(),
            "cluster": envs.KVPOOL_CLUSTER.get(),
        }
        if not settings["master"] and "master" not in overrides:
            settings.update(_local_cluster_settings(settings))
        cfg = ClientConfig(**{**settings, **overrides})
        return cls(config=cfg)

    def group_of(self, key: str) -> int:
        """The shard group that owns ``key`` (0 in a single-group cluster)."""
        return group_of(key, self.groups)

    def _deadline(self, timeout: float | None) -> Deadline:
        """None: the configured default; infinity: no deadline; NaN is refused."""
        if timeout is None:
            return Deadline(self.config.timeout_s)
        if math.isnan(timeout):
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "timeout is NaN")
        return Deadline(None if timeout == math.inf else timeout)

    def batch_limits(self) -> tuple[int, int]:
        """The master's batch limits (keys, key bytes per call); a larger batch is split (client/batching.py)."""
        return self._master.batch_limits(Deadline(min(self.config.timeout_s, 2.0)))

    # --- lookups -------------------------------------------------------------------------------

    @split_batches()
    def batch_exists(self, keys: Sequence[str], timeout: float | None = None) -> list[int]:
        """1 (present), 0 (missing) or a negative code per key (the master is unreachable)."""
        if not keys:
            return []
        try:
            resp = self._master.call(
                frames.Op.BATCH_EXISTS, _keyed(pb.BatchExistsRequest, keys), self._deadline(timeout)
            )
        except KvPoolError as exc:
            self._counters.add(degraded_calls=1)
            return [int(exc.code)] * len(keys)
        found = [1 if e else 0 for e in resp.exists]
        self._counters.add(lookups=len(keys), lookup_hits=sum(found))
        return found

    def is_exist(self, key: str, timeout: float | None = None) -> int:
        return self.batch_exists([key], timeout)[0]

    @split_batches(prefix=True)
    def prefix_length(self, keys: Sequence[str], timeout: float | None = None) -> int:
        """How many leading keys are in the pool (stops at the first miss); 0 when the master is down."""
        if not keys:
            return 0
        try:
            resp = self._master.call(
                frames.Op.BATCH_EXISTS,
                _keyed(pb.BatchExistsRequest, keys, prefix=True),
                self._deadline(timeout),
            )
        except KvPoolError:
            self._counters.add(degraded_calls=1)
            return 0
        self._counters.add(lookups=len(keys), lookup_hits=resp.prefix_length)
        return int(resp.prefix_length)

    # --- writes --------------------------------------------------------------------------------

    def put(self, key: str, value: Buffer, config: PutConfig | None = None, timeout: float | None = None) -> int:
        return self.batch_put_from([key], [value], config, timeout)[0]

    def batch_put(
        self,
        keys: Sequence[str],
        values: Sequence[Buffer],
        config: PutConfig | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        return self.batch_put_from(keys, values, config, timeout)

    @split_batches(per_key_args=1)
    def batch_put_from(
        self,
        keys: Sequence[str],
        buffers: Sequence[Buffer],
        config: PutConfig | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        """Store each buffer under its key (zero-copy from the buffers): 0 or a negative code per key."""
        if len(keys) != len(buffers):
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        deadline = self._deadline(timeout)
        views = [_byte_view(b, writable=False) for b in buffers]
        codes = [int(ErrorCode.OK)] * len(keys)
        request = _keyed(
            pb.BatchPutStartRequest,
            keys,
            client_id=self.client_id,
            sizes=[len(v) for v in views],
            config=(config or PutConfig()).to_proto(self.config.replica_num, self.node),
        )
        try:
            started = self._start_puts(request, deadline)
        except KvPoolError as exc:
            self._revoke_unanswered(keys, exc)
            self._counters.add(put_errors=len(keys), degraded_calls=1)
            return [int(exc.code)] * len(keys)
        if self._unanswered:
            try:
                self._retake_unanswered(request, started, deadline)
            except KvPoolError as exc:  # the keys started above will not be written
                self._abandon(keys)
                self._counters.add(put_errors=len(keys), degraded_calls=1)
                return [int(exc.code)] * len(keys)
        # Each value's checksum is computed by the transport lane that sends it, just before the send.
        sums = [LazyChecksum(v) for v in views]
        transfers: list[tuple[int, TransferRequest]] = []
        for i, result in enumerate(started.results):
            code = as_code(result.code)
            if code != ErrorCode.OK:
                codes[i] = 0 if code in _PUT_OK else int(code)
                continue
            key_bytes = keys[i].encode()
            for desc in result.replicas:
                transfers.append((i, TransferRequest(GrantOp.WRITE, key_bytes, replica_of(desc), views[i], sums[i])))
        written = self._write_all(transfers, deadline)
        failpoint(CLIENT_PUT_BEFORE_END)  # chaos tests: a writer dying between the transfers and PutEnd
        self._finish_puts(keys, started.results, written, sums, codes, deadline)
        ok = sum(1 for c in codes if c == 0)
        self._counters.add(
            puts=ok,
            put_errors=len(keys) - ok,
            put_bytes=sum(len(v) for v, c in zip(views, codes, strict=True) if c == 0),
        )
        return codes

    def _start_puts(self, request: pb.BatchPutStartRequest, deadline: Deadline) -> pb.BatchPutStartResponse:
        """BatchPutStart. Keys refused with DEMOTION_BACKLOG (DRAM full of objects being demoted to an SSD
        tier: docs/ssd-tier.md) are asked for again after a pause that doubles each time, until the
        deadline; past it they keep that code (the put fails, counted as a put error)."""
        started: pb.BatchPutStartResponse = self._master.call(frames.Op.BATCH_PUT_START, request, deadline)
        pause = BACKLOG_FIRST_PAUSE_S
        while True:
            waiting = [i for i, r in enumerate(started.results) if r.code == ErrorCode.DEMOTION_BACKLOG]
            remaining = deadline.remaining()
            if not waiting or (remaining is not None and remaining <= pause):
                return started
            time.sleep(pause)
            pause = min(2 * pause, BACKLOG_MAX_PAUSE_S)
            again = pb.BatchPutStartRequest(
                keys=[request.keys[i] for i in waiting],
                sizes=[request.sizes[i] for i in waiting],
                client_id=request.client_id,
                config=request.config,
            )
            self._counters.add(put_backlog_retries=len(waiting))
            try:
                answer = self._master.call(frames.Op.BATCH_PUT_START, again, deadline)
            except KvPoolError as exc:  # the deadline ran out during the retry: those keys keep saying why
                self._revoke_unanswered(again.keys, exc)
                return started
            for i, result in zip(waiting, answer.results, strict=True):
                started.results[i].CopyFrom(result)

    def _revoke_unanswered(self, keys: Sequence[str], exc: KvPoolError) -> None:
        """A BatchPutStart whose answer did not come before the deadline may still have been carried out:
        its keys would stay unfinished puts of this client that nobody writes, and a later put of them would
        be answered OBJECT_NOT_READY (counted as success) until the master reclaims them after put_timeout_s:
        an acknowledged put lost. Revoke them (the master leaves keys this client did not start alone). The
        master answers requests one at a time, so the revoke, sent after the start, normally finds it done."""
        if exc.code == ErrorCode.TIMEOUT:  # not when refused, or unreachable (a new leader knows no such put)
            self._abandon(keys)

    def _abandon(self, keys: Sequence[str]) -> None:
        """Revoke puts this client may have started and will not write, and remember them: the revoke may
        fail or overtake the start (client/unanswered_puts.py)."""
        self._unanswered.note(keys)
        try:
            self._revoke(keys, Deadline(_REVOKE_TIMEOUT_S))
        except KvPoolError as revoke_exc:
            log.debug("revoking %d unanswered puts failed (%s): a later put of them does", len(keys), revoke_exc)

    def _revoke(self, keys: Sequence[str], deadline: Deadline) -> None:
        self._master.call(
            frames.Op.BATCH_PUT_REVOKE,
            pb.BatchPutRevokeRequest(client_id=self.client_id, keys=list(keys)),
            deadline,
        )

    def _retake_unanswered(
        self, request: pb.BatchPutStartRequest, started: pb.BatchPutStartResponse, deadline: Deadline
    ) -> None:
        """Keys answered OBJECT_NOT_READY that an unanswered start of this client may hold: revoke them and
        ask again, so that the answer is about a put that someone will finish (raises KvPoolError)."""
        stale = [
            i
            for i, r in enumerate(started.results)
            if self._unanswered.forget(request.keys[i]) and r.code == ErrorCode.OBJECT_NOT_READY
        ]
        if not stale:
            return
        keys = [request.keys[i] for i in stale]
        self._revoke(keys, Deadline(max(deadline.remaining() or 0.0, _REVOKE_TIMEOUT_S)))
        again = pb.BatchPutStartRequest(
            keys=keys, sizes=[request.sizes[i] for i in stale], client_id=request.client_id, config=request.config
        )
        answer = self._start_puts(again, deadline)
        for i, result in zip(stale, answer.results, strict=True):
            started.results[i].CopyFrom(result)

    def _write_all(self, transfers: list[tuple[int, TransferRequest]], deadline: Deadline) -> dict[int, ErrorCode]:
        """Write every replica; a key's code is its first failure (all replicas must land)."""
        outcome: dict[int, ErrorCode] = {}
        results = self._transports.transfer([t for _, t in transfers], deadline)
        self._store_failures.note([t for _, t in transfers], results)
        for (i, _), code in zip(transfers, results, strict=True):
            if outcome.get(i, ErrorCode.OK) == ErrorCode.OK:
                outcome[i] = code
        return outcome

    def _finish_puts(
        self,
        keys: Sequence[str],
        results: Any,
        written: dict[int, ErrorCode],
        sums: list[LazyChecksum],
        codes: list[int],
        deadline: Deadline,
    ) -> None:
        done = [i for i, code in written.items() if code == ErrorCode.OK]
        failed = [i for i, code in written.items() if code != ErrorCode.OK]
        for i in failed:
            codes[i] = int(written[i])
        # PutEnd/PutRevoke get their own short deadline: a put whose data landed must not be lost
        # because the transfers used up the caller's budget.
        finish = Deadline(max(deadline.remaining() or 0.0, 1.0))
        if done:
            try:
                resp = self._master.call(
                    frames.Op.BATCH_PUT_END,
                    pb.BatchPutEndRequest(
                        client_id=self.client_id,
                        keys=[keys[i] for i in done],
                        checksums=[sums[i].value for i in done],
                    ),
                    finish,
                )
                for i, code in zip(done, resp.codes, strict=True):
                    codes[i] = 0 if as_code(code) in _PUT_OK else int(code)
            except KvPoolError as exc:
                for i in done:
                    codes[i] = int(exc.code)
        if failed:
            try:
                self._master.call(
                    frames.Op.BATCH_PUT_REVOKE,
                    pb.BatchPutRevokeRequest(client_id=self.client_id, keys=[keys[i] for i in failed]),
                    finish,
                )
            except KvPoolError as exc:  # the master reclaims abandoned puts after put_timeout
                log.warning("put revoke failed (%s); the master will reclaim the space", exc)

    # --- reads ---------------------------------------------------------------------------------

    def get(self, key: str, timeout: float | None = None) -> bytes | None:
        """The value, or None if the key is missing (or unreadable: see ``get_into`` for the code)."""
        return self.batch_get([key], timeout)[0]

    @split_batches(timed_out=None)
    def batch_get(self, keys: Sequence[str], timeout: float | None = None) -> list[bytes | None]:
        """Each value as new ``bytes`` the caller owns (None where missing or unreadable). The objects land
        in this thread's reusable read buffer and are copied once from there into their ``bytes``: no
        zero-filled or freshly faulted memory per call. ``batch_get_into`` lands them in the caller's
        buffers with no copy at all."""
        if not keys:
            return []
        deadline = self._deadline(timeout)
        if len(keys) == 1 and self._speculation.target() is not None:
            landing, views = self._landing_views([self._speculation.max_bytes])
            try:
                results, cached, hinted, got = self._lookup(keys, deadline, views)
                if got is not None and got[0] is not None:
                    return [bytes(views[0][: got[0]])]
            finally:
                views[0].release()
                landing.release()
        else:
            results, cached, hinted, _ = self._lookup(keys, deadline, None)
        landing, views = self._landing_views([r.size if r.code == 0 else 0 for r in results])
        try:
            codes = self._read_resolved(keys, results, cached, hinted, views, deadline)
            return [bytes(v[:c]) if c >= 0 else None for v, c in zip(views, codes, strict=True)]
        finally:
            for view in views:
                view.release()
            landing.release()

    def _landing_views(self, sizes: list[int]) -> tuple[memoryview, list[memoryview]]:
        """This thread's read buffer (grown to the call's total and kept up to ``_SCRATCH_KEEP`` bytes;
        a larger call gets a buffer of its own) and one slice of it per size."""
        total = sum(sizes)
        scratch = self._scratch
        buf: bytearray | None = getattr(scratch, "buf", None)
        if buf is None or len(buf) < total:
            buf = bytearray(total)
            if total <= _SCRATCH_KEEP:
                scratch.buf = buf
        landing = memoryview(buf)
        views = []
        offset = 0
        for size in sizes:
            views.append(landing[offset : offset + size])
            offset += size
        return landing, views

    def get_into(self, key: str, buffer: Buffer, timeout: float | None = None) -> int:
        return self.batch_get_into([key], [buffer], timeout)[0]

    @split_batches(per_key_args=1)
    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Buffer], timeout: float | None = None) -> list[int]:
        """Read each object into its buffer (zero-copy): bytes read, or a negative code per key."""
        if len(keys) != len(buffers):
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        deadline = self._deadline(timeout)
        views = [_byte_view(b, writable=True) for b in buffers]
        results, cached, hinted, got = self._lookup(keys, deadline, views)
        if got is not None:
            return self._read_rest(keys, results, cached, hinted, views, got, deadline)
        return self._read_resolved(keys, results, cached, hinted, views, deadline)

    def _lookup(
        self, keys: Sequence[str], deadline: Deadline, views: list[memoryview] | None
    ) -> tuple[list[_Resolved], list[int], dict[int, list[Replica]], list[int | None] | None]:
        """``_get_replicas``; for keys this client holds no location of, speculative reads by key (decision
        0031) into ``views`` go to the expected store first: per key, the object's size where the master's
        answer confirmed it (that read is done), else None; None when none were sent."""
        sent = None
        if views is not None and self._speculates(keys, views):
            sent = self._speculation.send(keys, [len(v) for v in views], deadline)
        results, cached, hinted = self._get_replicas(keys, deadline)
        got = None
        if sent is not None and views is not None:
            got = self._speculation.finish(sent, results, views, deadline)
            self._count_reads([size for size in got if size is not None])
        if (got is None or got[0] is None) and not cached and results[0].replicas:
            self._speculation.learn(self._transports.revalidating(results[0].replicas))  # where objects live
        return results, cached, hinted, got

    def _speculates(self, keys: Sequence[str], views: list[memoryview]) -> bool:
        """Whether to read ``keys`` by key while the master answers: a store to ask, no key with a location
        here, and (for a batch) small pages only."""
        if self._speculation.target() is None:
            return False
        if len(keys) > 1 and (
            not self.config.speculative_batches or any(len(v) > _SPECULATIVE_BATCH_PART for v in views)
        ):
            return False
        return not any(self._leases.knows(key) for key in keys)

    def _read_rest(
        self,
        keys: Sequence[str],
        results: list[_Resolved],
        cached: list[int],
        hinted: dict[int, list[Replica]],
        views: list[memoryview],
        got: list[int | None],
        deadline: Deadline,
    ) -> list[int]:
        """``_read_resolved`` of the keys a speculative read did not settle; the others keep their sizes."""
        rest = [i for i, size in enumerate(got) if size is None]
        codes = [size or 0 for size in got]
        if rest:
            in_cache = set(cached)
            for i, code in zip(
                rest,
                self._read_resolved(
                    [keys[i] for i in rest],
                    [results[i] for i in rest],
                    [j for j, i in enumerate(rest) if i in in_cache],
                    {j: hinted[i] for j, i in enumerate(rest) if i in hinted},
                    [views[i] for i in rest],
                    deadline,
                ),
                strict=True,
            ):
                codes[i] = code
        return codes

    def batch_get_into_ptrs(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], timeout: float | None = None
    ) -> list[int]:
        """``batch_get_into`` for raw host-memory pointers (Mooncake's signature)."""
        return self.batch_get_into(keys, [ptr_view(p, s) for p, s in zip(ptrs, sizes, strict=True)], timeout)

    def batch_put_from_ptrs(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        config: PutConfig | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        return self.batch_put_from(keys, [ptr_view(p, s) for p, s in zip(ptrs, sizes, strict=True)], config, timeout)

    def _get_replicas(
        self, keys: Sequence[str], deadline: Deadline, use_cache: bool = True, renewal: bool = False
    ) -> tuple[list[_Resolved], list[int], dict[int, list[Replica]]]:
        """One result per key (a failed master call gives results carrying its code: UNAVAILABLE, ...),
        the positions answered from the lease cache, which asks the master only for the others, and of
        those the ones answered from a hint (an ended lease), with the replicas to revalidate them on.
        A ``renewal``'s answers are not cached if this client dropped entries meanwhile (a removal)."""
        leases = self._leases
        drops = leases.drops if renewal else None
        found: list[_Resolved | None] = (
            [leases.get(key) for key in keys] if use_cache and leases.enabled else [None] * len(keys)
        )
        hinted: dict[int, list[Replica]] = {}
        if use_cache and leases.keeps_hints and None in found:
            for i, r in enumerate(found):
                hint = leases.hint(keys[i]) if r is None else None
                if hint is not None and (replicas := self._transports.revalidating(hint.replicas)):
                    found[i] = hint
                    hinted[i] = replicas
                    leases.hint_used(keys[i])
        cached = [i for i, r in enumerate(found) if r is not None]
        if len(cached) > len(hinted):
            self._counters.add(lease_cache_hits=len(cached) - len(hinted))
        if len(cached) < len(keys):
            missing = [i for i, r in enumerate(found) if r is None]
            asked = [keys[i] for i in missing] if cached else list(keys)
            try:
                resp = self._master.call(
                    frames.Op.BATCH_GET_REPLICAS, _keyed(pb.BatchGetReplicasRequest, asked), deadline
                )
                answers = [_resolved(r) for r in resp.results]
            except KvPoolError as exc:
                self._counters.add(degraded_calls=1)
                answers = [_Resolved(int(exc.code))] * len(asked)
            readable = []
            for i, key, result in zip(missing, asked, answers, strict=True):
                found[i] = result
                if result.code == ErrorCode.OK:
                    readable.append((key, result))
            leases.put_many(readable, unless_dropped_since=drops)
        return cast(list[_Resolved], found), cached, hinted  # every position is filled now

    def _report_store_failures(self, endpoints: list[str]) -> None:
        """The failure reporter's call (client/store_failures.py): stores this client could not connect to."""
        request = pb.ReportStoreFailuresRequest(client_id=self.client_id, tcp_endpoints=endpoints)
        self._master.call(frames.Op.REPORT_STORE_FAILURES, request, Deadline(1.0))

    def _renew_leases(self, keys: list[str]) -> None:
        """The lease renewer's call: fresh leases (and descriptors) for cached objects still being read.
        An object gone meanwhile leaves the cache; while the master cannot be reached, the entries stay
        and end with their leases."""
        results, _, _ = self._get_replicas(keys, self._deadline(None), use_cache=False, renewal=True)
        gone = [key for key, r in zip(keys, results, strict=True) if r.code == ErrorCode.OBJECT_NOT_FOUND]
        if gone:
            self._leases.drop(gone)
        self._counters.add(lease_renewals=sum(1 for r in results if r.code == ErrorCode.OK))

    def _read_resolved(
        self,
        keys: Sequence[str],
        results: list[_Resolved],
        cached: list[int],
        hinted: dict[int, list[Replica]],
        views: list[memoryview],
        deadline: Deadline,
    ) -> list[int]:
        """Read every resolved key; a read from a cached lease (or a hint) that failed is resolved again
        at the master."""
        codes = self._read_all(keys, results, views, deadline, hinted)
        if hinted:
            refused = sum(1 for i in hinted if codes[i] < 0)
            self._counters.add(revalidated_reads=len(hinted) - refused, revalidations_refused=refused)
        retry = [i for i in cached if codes[i] < 0]
        if retry and not deadline.expired():
            retry_keys = [keys[i] for i in retry]
            self._leases.drop(retry_keys)
            fresh, _, _ = self._get_replicas(retry_keys, deadline, use_cache=False)
            for i, code in zip(
                retry, self._read_all(retry_keys, fresh, [views[i] for i in retry], deadline), strict=True
            ):
                codes[i] = code
        self._count_reads(codes)
        return codes

    def _read_all(
        self,
        keys: Sequence[str],
        results: list[_Resolved],
        views: list[memoryview],
        deadline: Deadline,
        hinted: dict[int, list[Replica]] | None = None,
    ) -> list[int]:
        """Read each found object from one replica, falling back to the next replica on failure; a
        ``hinted`` one (its lease has ended) only from the given replicas, as a revalidated read."""
        hinted = hinted or {}
        codes = [0] * len(keys)
        pending: dict[int, list[Replica]] = {}
        for i, r in enumerate(results):
            if r.code:
                codes[i] = int(as_code(r.code))
            elif len(views[i]) < r.size:
                codes[i] = int(ErrorCode.BUFFER_TOO_SMALL)
            elif not r.replicas:
                codes[i] = int(ErrorCode.OBJECT_NOT_FOUND)
            elif i in hinted:
                pending[i] = self._unsuspected_first(hinted[i])
            else:
                replicas = r.replicas
                pending[i] = (
                    self._unsuspected_first(self._transports.order(replicas)) if len(replicas) > 1 else list(replicas)
                )
        while pending:
            batch = {i: replicas.pop(0) for i, replicas in pending.items()}
            attempt = self._attempt_deadline(deadline, min(len(pending[i]) for i in batch))
            # The transport verifies each object's checksum as soon as its bytes land.
            requests = [
                TransferRequest(
                    GrantOp.READ,
                    keys[i].encode(),
                    rep,
                    views[i][: results[i].size],
                    results[i].checksum,
                    True,
                    i in hinted,
                )
                for i, rep in batch.items()
            ]
            transferred = self._transports.transfer(requests, attempt)
            self._store_failures.note(requests, transferred)
            for (i, rep), code in zip(batch.items(), transferred, strict=True):
                if code == ErrorCode.TIMEOUT and attempt is not deadline:
                    self._suspect(rep)
                code = self._verify(code, results[i], i in hinted)
                codes[i] = results[i].size if code == ErrorCode.OK else int(code)
                if code == ErrorCode.OK or not pending[i] or deadline.expired():
                    del pending[i]
        return codes

    def _attempt_deadline(self, deadline: Deadline, fallbacks: int) -> Deadline:
        """The deadline of one round of reads: when every object of the round has ``fallbacks`` (>= 1)
        other replicas left, an equal share of what is left of the call's deadline (of the configured
        timeout, for a call without one), so that a replica that does not answer (a hung store) leaves
        time to read another; otherwise the call's deadline."""
        if fallbacks < 1:
            return deadline
        remaining = deadline.remaining()
        budget = self.config.timeout_s if remaining is None else remaining
        return Deadline(budget / (fallbacks + 1))

    def _suspect(self, replica: Replica) -> None:
        """A replica's store did not answer within its share: read its other objects from elsewhere
        first for a while (it is still tried, last, where it is the only one left)."""
        with self._suspects_lock:
            self._suspects[replica.tcp_endpoint] = time.monotonic() + _SUSPECT_S

    def _unsuspected_first(self, replicas: Sequence[Replica]) -> list[Replica]:
        """``replicas`` (in read preference), those on stores suspected of hanging moved last."""
        if not self._suspects:
            return list(replicas)
        now = time.monotonic()
        with self._suspects_lock:
            for endpoint in [e for e, until in self._suspects.items() if until <= now]:
                del self._suspects[endpoint]
            suspects = set(self._suspects)
        return sorted(replicas, key=lambda r: r.tcp_endpoint in suspects)

    def _verify(self, code: ErrorCode, result: _Resolved, revalidated: bool = False) -> ErrorCode:
        """The transport checked the bytes against the checksum; the lease must still hold too, unless
        the store revalidated the read (it held exactly this object when it sent the bytes)."""
        if code == ErrorCode.CHECKSUM_MISMATCH:
            self._counters.add(checksum_mismatches=1)
        if code != ErrorCode.OK or revalidated:
            return code
        if self._clock.wall_ms() > result.lease_expiry_ms:
            # The lease ran out during the transfer: the object may have been evicted and its range
            # rewritten while we read it, so these bytes cannot be trusted even if the checksum matched.
            self._counters.add(lease_expired=1)
            return ErrorCode.LEASE_EXPIRED
        return ErrorCode.OK

    def _count_reads(self, codes: list[int]) -> None:
        ok = got = misses = 0
        for code in codes:
            if code >= 0:
                ok += 1
                got += code
            elif code == ErrorCode.OBJECT_NOT_FOUND:
                misses += 1
        self._counters.add(gets=ok, get_bytes=got, get_misses=misses, get_errors=len(codes) - ok - misses)

    # --- removal, pins, buffers, stats ----------------------------------------------------------

    def remove(self, key: str, force: bool = False, timeout: float | None = None) -> int:
        return self.batch_remove([key], force, timeout)[0]

    @split_batches()
    def batch_remove(self, keys: Sequence[str], force: bool = False, timeout: float | None = None) -> list[int]:
        self._leases.drop(keys)
        try:
            resp = self._master.call(
                frames.Op.BATCH_REMOVE,
                _keyed(pb.BatchRemoveRequest, keys, force=force),
                self._deadline(timeout),
            )
        except KvPoolError as exc:
            return [int(exc.code)] * len(keys)
        return [int(c) for c in resp.codes]

    def remove_all(self, force: bool = False, prefix: str = "", timeout: float | None = None) -> int:
        """Remove every object (whose key starts with ``prefix``); returns how many, or a negative code."""
        if not _is_utf8(prefix):
            return int(ErrorCode.INVALID_KEY)
        self._leases.clear()
        try:
            resp = self._master.call(
                frames.Op.REMOVE_ALL, pb.RemoveAllRequest(force=force, prefix=prefix), self._deadline(timeout)
            )
        except KvPoolError as exc:
            return int(exc.code)
        return int(resp.removed)

    def register_buffer(self, buffer: Buffer) -> int:
        """Register host memory for zero-copy transfers (an RDMA memory region where RDMA is used)."""
        self._transports.register_memory(_byte_view(buffer, writable=False))
        return 0

    def unregister_buffer(self, buffer: Buffer) -> int:
        self._transports.unregister_memory(_byte_view(buffer, writable=False))
        return 0

    def stats(self, timeout: float = 10.0) -> pb.StatsResponse:
        """The master's view of the cluster (objects, capacity, hit counters, segments)."""
        stats: pb.StatsResponse = self._master.call(frames.Op.GET_STATS, pb.StatsRequest(), Deadline(timeout))
        return stats

    def metrics(self) -> dict[str, int]:
        """This client's counters, for the engine to publish."""
        values = self._counters.snapshot()
        values["degraded"] = int(self._master.degraded)
        values["speculative_reads"] = self._speculation.confirmed
        values["speculative_reads_discarded"] = self._speculation.discarded
        values.update({f"bytes_{name}": n for name, n in self._transports.bytes_by_transport().items()})
        return values

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._renewer is not None:
            self._renewer.close()
        self._store_failures.close()
        self._speculation.close()
        self._transports.close()
        self._master.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Resolved(NamedTuple):
    """A master's answer for one key to read, in plain Python: converted once, so that a read served
    from the lease cache does not pay for protobuf field access again (docs/decisions/0010)."""

    code: int
    size: int = 0
    checksum: int = 0
    lease_expiry_ms: int = 0
    replicas: tuple[Replica, ...] = ()


def _resolved(r: pb.GetReplicasResult) -> _Resolved:
    # tuple.__new__ builds the named tuples with every field given, without their generated __new__
    # (a third of the conversion of a batched lookup's answers, which a first read pays per key).
    return _new_tuple(
        _Resolved,
        (r.code, r.size, r.checksum, r.lease_expiry_ms, tuple([_replica(d) for d in r.replicas])),
    )


def _replica(d: pb.ReplicaDescriptor) -> Replica:
    """``replica_of(d)``, every field of Replica given in its order."""
    return _new_tuple(
        Replica, (d.segment_id, d.node, d.tcp_endpoint, d.shm_path, d.offset, d.length, d.expiry_ms, d.mac, d.tier)
    )


_new_tuple: Callable[[type[R], tuple[Any, ...]], R] = tuple.__new__  # type: ignore[assignment]
