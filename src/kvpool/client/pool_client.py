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

import logging
import math
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from kvpool.client.batching import split_batches
from kvpool.client.call_parts import (
    Buffer,
    PutConfig,
    _byte_view,
    _Counters,
    _is_utf8,
    _keyed,
    _replica,
    ptr_view,
)
from kvpool.client.config import ClientConfig
from kvpool.client.device_buffers import DeviceBuffers, find_cuda
from kvpool.client.group_router import GroupRouter, connect_master
from kvpool.client.lease_cache import LeaseCache, LeaseRenewer
from kvpool.client.master_client import MasterClient
from kvpool.client.read_by_key import SpeculativeReads
from kvpool.client.read_path import ReadPathMixin
from kvpool.client.store_failures import StoreFailureReporter
from kvpool.client.unanswered_puts import UnansweredPuts
from kvpool.client.write_path import _PUT_OK, WritePathMixin
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
from kvpool.transfer.base import TransferRequest
from kvpool.transfer.registry import TransportSet

__all__ = ["Buffer", "PoolClient", "PutConfig", "ptr_view"]


log = get_logger(__name__)


def _local_cluster_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The master (and token file) of the running local cluster, if there is one (common/local_context.py)."""
    from kvpool.common import local_context

    context = local_context.current()
    if context is None:
        return {}
    log_once(log, logging.WARNING, f"local:{context.master}", "KVPOOL_MASTER is not set: %s", context.describe())
    return {"master": context.master, "token_file": settings["token_file"] or context.token_file}


class PoolClient(ReadPathMixin, WritePathMixin):
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
        self.device_buffers = DeviceBuffers(self._transports)
        """CUDA buffers in batch_put_from / batch_get_into (client/device_buffers.py, decision 0023)."""
        self._closed = False
        self._default_put_config: pb.PutConfig | None = None  # built on the first put (_put_config_proto)

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
        cuda = find_cuda(buffers)
        if cuda is not None:
            return self.device_buffers.put(self, keys, buffers, cuda, config, timeout)
        deadline = self._deadline(timeout)
        views = [_byte_view(b, writable=False) for b in buffers]
        codes = [int(ErrorCode.OK)] * len(keys)
        request = _keyed(
            pb.BatchPutStartRequest,
            keys,
            client_id=self.client_id,
            sizes=[len(v) for v in views],
            config=self._put_config_proto(config),
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
            if result.code:
                code = as_code(result.code)
                codes[i] = 0 if code in _PUT_OK else int(code)
                continue
            key_bytes = keys[i].encode()
            for desc in result.replicas:
                transfers.append((i, TransferRequest(GrantOp.WRITE, key_bytes, _replica(desc), views[i], sums[i])))
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

    def _put_config_proto(self, config: PutConfig | None) -> pb.PutConfig:
        """The request's placement options; the default ones built once per client (every put sends them)."""
        if config is not None:
            return config.to_proto(self.config.replica_num, self.node)
        if self._default_put_config is None:
            self._default_put_config = PutConfig().to_proto(self.config.replica_num, self.node)
        return self._default_put_config

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

    def get_into(self, key: str, buffer: Buffer, timeout: float | None = None) -> int:
        return self.batch_get_into([key], [buffer], timeout)[0]

    @split_batches(per_key_args=1)
    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Buffer], timeout: float | None = None) -> list[int]:
        """Read each object into its buffer (zero-copy): bytes read, or a negative code per key."""
        if len(keys) != len(buffers):
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        cuda = find_cuda(buffers)
        if cuda is not None:
            return self.device_buffers.get_into(self, keys, buffers, cuda, timeout)
        deadline = self._deadline(timeout)
        views = [_byte_view(b, writable=True) for b in buffers]
        results, cached, hinted, got = self._lookup(keys, deadline, views)
        if got is not None:
            return self._read_rest(keys, results, cached, hinted, views, got, deadline)
        return self._read_resolved(keys, results, cached, hinted, views, deadline)

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

    def _report_store_failures(self, endpoints: list[str]) -> None:
        """The failure reporter's call (client/store_failures.py): stores this client could not connect to."""
        request = pb.ReportStoreFailuresRequest(client_id=self.client_id, tcp_endpoints=endpoints)
        self._master.call(frames.Op.REPORT_STORE_FAILURES, request, Deadline(1.0))

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
        """Register host memory for zero-copy transfers (an RDMA memory region where RDMA is used); a CUDA buffer's
        allocation is registered once, until the client closes (decision 0023)."""
        if find_cuda([buffer]) is not None:
            self.device_buffers.register(buffer)
            return 0
        self._transports.register_memory(_byte_view(buffer, writable=False))
        return 0

    def unregister_buffer(self, buffer: Buffer) -> int:
        if find_cuda([buffer]) is not None:
            return 0  # GPU registrations are cached per allocation until the client closes
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
        values.update(self.device_buffers.metrics())
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
