"""The master process: the pure MasterState behind gRPC (control plane) and the lean framed protocol
(the engine's hot calls), plus the maintenance thread (eviction, store expiry, put reclaim) and the
/metrics and /health endpoint.

Concurrency model: one asyncio loop serves both protocols and calls MasterState directly (its
operations are short and never block on I/O); one maintenance thread calls the periodic operations,
which take shard locks one at a time, so lookups of other objects never stall behind a scan.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import xxhash
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.common import tls
from kvpool.common.auth import TokenChecker
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.groups import group_of, wrong_group
from kvpool.common.httpserver import MetricsServer
from kvpool.common.log import get_logger
from kvpool.master import convert, tier_service
from kvpool.master.config import MasterConfig
from kvpool.master.drain import DrainController, DrainManager
from kvpool.master.drain_service import DrainRpc
from kvpool.master.idle_poll import IdlePoller
from kvpool.master.limits import max_request_payload
from kvpool.master.request_metrics import RequestMetrics
from kvpool.master.standby import StandbyIndex
from kvpool.master.standby_rpc import StandbyRpc
from kvpool.master.state import MasterState
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.proto import master_pb2_grpc as pb_grpc

log = get_logger(__name__)

_native_foreign: Callable[[Any, int, int], int] | None
try:
    from kvpool.master._index import foreign as _native_foreign
except ImportError:  # built without a C compiler or xxHash's header (setup.py): hashed in Python
    _native_foreign = None

# Methods any master answers even when it is not the leader (they describe the cluster).
_ALWAYS_SERVED = frozenset({"GetClusterInfo", "GetStats"})
# Methods a newly elected leader accepts during its warm-up: stores re-mount and rebuild the index
# before the first data call is served.
_MEMBERSHIP = frozenset({"MountSegment", "RemountSegment", "Heartbeat", "UnmountSegment"})
# The stores' inventory feed to warm standbys (master/standby.py): it decides itself whom it accepts.
_STANDBY_FEED = frozenset({"StandbySync", "StandbyDelta"})
# Most payload a framed connection may send before its HELLOs are accepted (the handshake's fit in it).
_MAX_PREAUTH_PAYLOAD = 4096


class LeadershipProbe(Protocol):
    """What the role needs from a leader elector (kvpool.master.leader.LeaderElector)."""

    @property
    def view(self) -> int: ...

    @property
    def is_leader(self) -> bool: ...

    @property
    def is_warming_up(self) -> bool: ...

    def lease_valid_for(self) -> float: ...


@dataclass
class Role:
    """Whether this master may answer, and which view its answers carry.

    Without an elector the master is standalone and always serves. With one it serves data calls only
    while it leads *and* its lease is locally known to be valid, so a leader frozen past its lease
    (SIGSTOP) refuses to answer the moment it runs again.
    """

    elector: LeadershipProbe | None = None
    leader: str = ""  # the leader's gRPC endpoint when this one is not it
    followers: list[str] = field(default_factory=list)
    members: list[tuple[str, str]] = field(default_factory=list)
    """Every live master as (gRPC address, "leader" | "warming_up" | "standby"), from etcd (HA only)."""

    @property
    def view(self) -> int:
        return self.elector.view if self.elector is not None else 0

    @property
    def name(self) -> str:
        if self.elector is None:
            return "standalone"
        if self.elector.is_leader:
            return "leader"
        return "warmup" if self.elector.is_warming_up else "follower"

    @property
    def serving(self) -> bool:
        return self.elector is None or (self.elector.is_leader and self.elector.lease_valid_for() > 0)

    def accepts(self, method: str) -> bool:
        if method in _ALWAYS_SERVED or method in _STANDBY_FEED or self.serving:
            return True
        return (
            method in _MEMBERSHIP
            and self.elector is not None
            and self.elector.is_warming_up
            and self.elector.lease_valid_for() > 0
        )


_MAX_REPORTED_ENDPOINTS = 1024
"""Most endpoints one failure report may name (a client reports the few stores it failed to reach)."""


class StoreProber(Collector):
    """The I/O edge of dead-store suspicion: connects to a reported store's data-plane port, off the request
    path (a thread per probe; MasterState rate-limits them per store), and hands the outcome to the state."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self.probes = {"reachable": 0, "unreachable": 0}
        """Probes finished, by outcome (``kvpool_master_store_probes_total{result}``)."""

    def probe(self, state: MasterState, tcp_endpoint: str) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(state, tcp_endpoint), name="store-probe", daemon=True)
        thread.start()
        return thread

    def _run(self, state: MasterState, tcp_endpoint: str) -> None:
        host, _, port = tcp_endpoint.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout_s):
                reachable = True
        except (OSError, ValueError) as exc:
            log.info("probe of store data plane %s failed: %s", tcp_endpoint, exc)
            reachable = False
        state.store_probe_result(tcp_endpoint, reachable)
        with self._lock:
            self.probes["reachable" if reachable else "unreachable"] += 1

    def collect(self) -> Any:
        family = CounterMetricFamily(
            "kvpool_master_store_probes",
            "Probes of a store's data plane after a client reported it unreachable, by outcome",
            labels=["result"],
        )
        with self._lock:
            counts = dict(self.probes)
        for result, n in counts.items():
            family.add_metric([result], n)
        yield family


class MasterHandlers:
    """Decode -> MasterState -> encode. Shared by the gRPC servicer and the framed server."""

    def __init__(self, state: MasterState, config: MasterConfig, role: Role, endpoints: dict[str, str]) -> None:
        self.state = state
        self.config = config
        self.role = role
        self.endpoints = endpoints
        self._ok_status: pb.Status | None = None
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics()
        self.registry.register(self.requests)
        self.collector = _StateCollector(state, role)
        self.registry.register(self.collector)
        self._methods: dict[str, Callable[[Any], Any]] = {
            name: getattr(self, name) for name, _req, _resp in frames.RPC_METHODS.values()
        }
        for name in (
            "MountSegment",
            "RemountSegment",
            "UnmountSegment",
            "Heartbeat",
            "SetSegmentStatus",
            "TierTasks",
        ):
            self._methods[name] = getattr(self, name)
        # Drain, scale-in and rebalance (master/drain.py): store-to-store moves, pulled by the stores.
        self.drains = DrainManager(state, serving=lambda: self.role.serving)
        self.registry.register(self.drains.collector())
        self._methods.update(DrainRpc(self.drains, self.status).methods())
        self.prober = StoreProber(config.store_probe_timeout_s)
        self.registry.register(self.prober)
        # Warm standby (decision 0070): follow the stores' inventories while this master is a follower.
        self.standby = StandbyIndex(state, lambda: self.role.name == "follower")
        self._methods.update(StandbyRpc(self.standby, self.status).methods())

    def status(self, code: ErrorCode = ErrorCode.OK, message: str = "") -> pb.Status:
        """The status of an answer. Callers only pass it to a response's constructor (which copies it),
        so the OK status is built once per (view, leader) (figures: docs/decisions/0010, step 4)."""
        leader = self.role.leader if self.role.name != "leader" else self.endpoints.get("grpc", "")
        view = self.role.view
        if code != ErrorCode.OK or message:
            return pb.Status(code=int(code), message=message, view=view, leader=leader)
        cached = self._ok_status
        if cached is None or cached.view != view or cached.leader != leader:
            cached = self._ok_status = pb.Status(view=view, leader=leader)
        return cached

    def dispatch(self, method: str, request: Any, response_type: type) -> Any:
        """Run one call; a follower or a bad request gets an error status, never an exception."""
        started = time.perf_counter()
        try:
            if not self.role.accepts(method):
                name = self.role.name
                code = ErrorCode.LEADER_WARMING_UP if name == "warmup" else ErrorCode.NOT_LEADER
                return response_type(status=self.status(code, f"this master is {name}"))
            return self._methods[method](request)
        except KvPoolError as exc:
            return response_type(status=self.status(exc.code, exc.message))
        except Exception as exc:  # a bug must not take the master down; the caller gets INTERNAL
            log.exception("%s failed", method)
            return response_type(status=self.status(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        finally:
            self.requests.observe(method, time.perf_counter() - started)

    def _keys(self, wire_keys: Any, *, lookup: bool = False) -> list[str]:
        """A request's keys as a list (decoded from the message once: each access to the repeated field
        builds a new str), checked for the batch limit and, with groups, for the master's group."""
        if len(wire_keys) > self.config.max_batch:
            raise KvPoolError(ErrorCode.BATCH_TOO_LARGE, f"{len(wire_keys)} keys > max_batch {self.config.max_batch}")
        keys = list(wire_keys)
        if self.config.groups > 1 and not lookup:  # a lookup's keys are checked in the lookup's own pass
            self._check_group(keys)
        return keys

    def _check_group(self, keys: list[str]) -> None:
        """Refuse a batch holding a key of another shard group (decision 0080): a mis-routed put would
        store an object where its owner never looks, and a mis-routed read would miss. Every key is
        checked, in the compiled _index where it was built (docs/benchmarks.md, "Issue 28 follow-up")."""
        groups, mine = self.config.groups, self.config.group
        if _native_foreign is not None:
            found = _native_foreign(keys, groups, mine)
            if found >= 0:
                raise wrong_group(keys[found], groups, mine)
            return
        digest = xxhash.xxh64_intdigest  # group_of inlined into one set comprehension: it runs per key
        if {digest(key.encode()) % groups for key in keys} <= {mine}:
            return
        for key in keys:
            if group_of(key, groups) != mine:
                raise wrong_group(key, groups, mine)

    # --- cluster ---------------------------------------------------------------------------------

    def GetClusterInfo(self, req: pb.ClusterInfoRequest) -> pb.ClusterInfoResponse:  # noqa: N802
        return pb.ClusterInfoResponse(
            status=self.status(),
            grpc_endpoint=self.endpoints.get("grpc", ""),
            rpc_endpoint=self.endpoints.get("rpc", ""),
            metrics_endpoint=self.endpoints.get("metrics", ""),
            cluster=self.config.cluster,
            lease_ttl_ms=int(self.config.lease_ttl_s * 1000),
            max_key_bytes=self.config.max_key_bytes,
            max_object_bytes=self.config.max_object_bytes,
            max_batch=self.config.max_batch,
            group=self.config.group,
            groups=self.config.groups,
        )

    def GetStats(self, req: pb.StatsRequest) -> pb.StatsResponse:  # noqa: N802
        s = self.state.stats()
        return pb.StatsResponse(
            status=self.status(),
            segments=[_segment_info(seg) for seg in s.segments],
            objects=s.objects,
            capacity=s.capacity,
            used=s.used,
            hits=s.hits,
            misses=s.misses,
            evictions=s.evictions,
            evicted_bytes=s.evicted_bytes,
            puts=s.puts,
            reclaimed_puts=s.reclaimed_puts,
            role=self.role.name,
            leader=self.role.leader or self.endpoints.get("grpc", ""),
            followers=self.role.followers,
            masters=[pb.MasterMember(grpc=address, state=state) for address, state in self.role.members],
            extra=tier_service.stats_extra(self.state),
        )

    # --- membership ------------------------------------------------------------------------------

    def MountSegment(self, req: pb.MountSegmentRequest) -> pb.MountSegmentResponse:  # noqa: N802
        # Through the standby index: a segment known from the feed is reconciled (decision 0070).
        result = self.standby.mount(
            convert.segment_spec(req.segment, req.secret), convert.inventory(req.inventory), req.remount
        )
        log.info(
            "segment %d of store %s (%s) mounted: %d objects adopted, %d rejected",
            req.segment.id,
            req.segment.store_id,
            req.segment.node,
            result.adopted,
            result.rejected,
        )
        if result.code == ErrorCode.OK:
            self.drains.on_mount(req.segment.id)  # a segment under a drain job is DRAINING at once
        return pb.MountSegmentResponse(
            status=self.status(result.code), adopted=result.adopted, rejected=result.rejected
        )

    RemountSegment = MountSegment

    def UnmountSegment(self, req: pb.UnmountSegmentRequest) -> pb.UnmountSegmentResponse:  # noqa: N802
        code, dropped = self.state.unmount_segment(req.segment_id, req.store_id)
        return pb.UnmountSegmentResponse(status=self.status(code), objects_dropped=dropped)

    def Heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatResponse:  # noqa: N802
        if self.standby.needs_remount(req.store_id):  # known from the standby feed only: reconcile first
            return pb.HeartbeatResponse(status=self.status(ErrorCode.NEED_REMOUNT))
        result = self.state.heartbeat(req.store_id, list(req.segment_ids), req.freed_ack)
        freed = [pb.FreedRange(segment_id=s, offset=o, seq=q, key=k) for s, o, q, k in result.freed]
        return pb.HeartbeatResponse(
            status=self.status(result.code), freed=freed, moves_pending=self.drains.pending_for(req.store_id)
        )

    def TierTasks(self, req: pb.TierTasksRequest) -> pb.TierTasksResponse:  # noqa: N802
        return tier_service.tier_tasks(self.state, req, self.status())

    def SetSegmentStatus(self, req: pb.SegmentStatusRequest) -> pb.BatchCodesResponse:  # noqa: N802
        codes = self.state.set_segment_status(list(req.segment_ids), int(req.status))
        return pb.BatchCodesResponse(status=self.status(), codes=[int(c) for c in codes])

    # --- objects ---------------------------------------------------------------------------------

    def BatchPutStart(self, req: pb.BatchPutStartRequest) -> pb.BatchPutStartResponse:  # noqa: N802
        keys = self._keys(req.keys)
        if len(req.sizes) != len(keys):
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "keys and sizes differ in length")
        results = self.state.put_start(req.client_id, keys, list(req.sizes), convert.put_options(req.config))
        response = pb.BatchPutStartResponse(status=self.status())
        convert.fill_put_start_results(response.results, results)
        return response

    def BatchPutEnd(self, req: pb.BatchPutEndRequest) -> pb.BatchCodesResponse:  # noqa: N802
        keys = self._keys(req.keys)
        if len(req.checksums) != len(keys):
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "keys and checksums differ in length")
        codes = self.state.put_end(req.client_id, keys, list(req.checksums))
        return pb.BatchCodesResponse(status=self.status(), codes=[int(c) for c in codes])

    def BatchPutRevoke(self, req: pb.BatchPutRevokeRequest) -> pb.BatchCodesResponse:  # noqa: N802
        codes = self.state.put_revoke(req.client_id, self._keys(req.keys))
        return pb.BatchCodesResponse(status=self.status(), codes=[int(c) for c in codes])

    def BatchGetReplicas(self, req: pb.BatchGetReplicasRequest) -> pb.BatchGetReplicasResponse:  # noqa: N802
        results = self.state.get_replicas(self._keys(req.keys), grant_lease=not req.no_lease)
        response = pb.BatchGetReplicasResponse(status=self.status())
        convert.fill_get_results(response.results, results)
        return response

    def BatchExists(self, req: pb.BatchExistsRequest) -> pb.BatchExistsResponse:  # noqa: N802
        keys = self._keys(req.keys, lookup=True)  # MasterState checks the keys' group in its lookup
        if req.prefix:
            return pb.BatchExistsResponse(status=self.status(), prefix_length=self.state.prefix_length(keys))
        return pb.BatchExistsResponse(status=self.status(), exists=self.state.exists(keys))

    def BatchRemove(self, req: pb.BatchRemoveRequest) -> pb.BatchCodesResponse:  # noqa: N802
        codes = self.state.remove(self._keys(req.keys), force=req.force)
        return pb.BatchCodesResponse(status=self.status(), codes=[int(c) for c in codes])

    def RemoveAll(self, req: pb.RemoveAllRequest) -> pb.RemoveAllResponse:  # noqa: N802
        return pb.RemoveAllResponse(status=self.status(), removed=self.state.remove_all(req.force, req.prefix))

    def ReportStoreFailures(self, req: pb.ReportStoreFailuresRequest) -> pb.ReportStoreFailuresResponse:  # noqa: N802
        if len(req.tcp_endpoints) > _MAX_REPORTED_ENDPOINTS:
            raise KvPoolError(
                ErrorCode.BATCH_TOO_LARGE, f"{len(req.tcp_endpoints)} endpoints > {_MAX_REPORTED_ENDPOINTS}"
            )
        report = self.state.report_store_failures(req.client_id, list(req.tcp_endpoints))
        for endpoint in report.probe:
            self.prober.probe(self.state, endpoint)
        if report.suspected:
            log.warning("stores at %s suspected dead: reported by clients", ", ".join(report.suspected))
        return pb.ReportStoreFailuresResponse(status=self.status(), suspected=report.suspected)

    def Pin(self, req: pb.PinRequest) -> pb.BatchCodesResponse:  # noqa: N802
        codes = self.state.pin(self._keys(req.keys), req.hard, req.soft_ttl_ms / 1000.0, req.unpin)
        return pb.BatchCodesResponse(status=self.status(), codes=[int(c) for c in codes])


def _segment_info(seg: Any) -> pb.SegmentInfo:
    return pb.SegmentInfo(
        id=seg.id,
        node=seg.node,
        store_id=seg.store_id,
        size=seg.size,
        tcp_endpoint=seg.tcp_endpoint,
        shm_path=seg.shm_path,
        status=int(seg.status),  # type: ignore[arg-type]
        numa_node=seg.numa_node,
        used=seg.used,
        objects=seg.objects,
        tier=seg.tier,
    )


class _StateCollector(Collector):
    """Gauges read from MasterState.stats() at scrape time: no cost on the request path."""

    def __init__(self, state: MasterState, role: Role) -> None:
        self.state = state
        self._role = role

    def collect(self) -> Any:
        s = self.state.stats()
        simple = {
            "kvpool_master_objects": ("Objects in the index", s.objects),
            "kvpool_master_capacity_bytes": ("Bytes of all mounted segments", s.capacity),
            "kvpool_master_used_bytes": ("Bytes allocated", s.used),
            "kvpool_master_hits_total": ("Lookups that found a readable object", s.hits),
            "kvpool_master_misses_total": ("Lookups that found nothing", s.misses),
            "kvpool_master_evictions_total": ("Objects evicted", s.evictions),
            "kvpool_master_evicted_bytes_total": ("Bytes evicted", s.evicted_bytes),
            "kvpool_master_puts_total": ("Puts completed", s.puts),
            "kvpool_master_reclaimed_puts_total": ("Abandoned puts reclaimed", s.reclaimed_puts),
            "kvpool_master_is_leader": ("1 when this master serves", 1 if self._role.serving else 0),
            "kvpool_master_view": ("Leader view (etcd revision)", self._role.view),
            "kvpool_master_suspected_stores": (
                "Stores suspected dead on client reports (decision 0026)",
                len(self.state.suspected_stores()),
            ),
        }
        for name, (doc, value) in simple.items():
            yield GaugeMetricFamily(name, doc, value=value)
        cap = GaugeMetricFamily("kvpool_segment_capacity_bytes", "Segment size", labels=["segment", "node"])
        used = GaugeMetricFamily("kvpool_segment_used_bytes", "Segment bytes in use", labels=["segment", "node"])
        for seg in s.segments:
            cap.add_metric([str(seg.id), seg.node], seg.size)
            used.add_metric([str(seg.id), seg.node], seg.used)
        yield cap
        yield used
        yield from tier_service.metric_families(self.state)


def _make_servicer(handlers: MasterHandlers) -> pb_grpc.MasterServiceServicer:
    """A gRPC servicer whose every method is ``handlers.dispatch`` (no per-method boilerplate)."""
    methods: dict[str, Any] = {}
    for method in pb.DESCRIPTOR.services_by_name["MasterService"].methods:
        response_type = getattr(pb, method.output_type.name)

        def call(self: Any, request: Any, context: Any, _m: str = method.name, _r: type = response_type) -> Any:
            return handlers.dispatch(_m, request, _r)

        methods[method.name] = call
    servicer: pb_grpc.MasterServiceServicer = type("MasterServicer", (pb_grpc.MasterServiceServicer,), methods)()
    return servicer


class _FramedRpcProtocol(asyncio.Protocol):
    """One framed-RPC connection, driven by callbacks (no coroutine per request: this is the hot path).

    Requests on a connection are answered in order. When the peer stops reading our answers, we stop
    reading its requests (``pause_writing`` -> ``pause_reading``), so a flooding client cannot grow the
    master's memory. A malformed frame closes this connection only.
    """

    def __init__(self, handlers: MasterHandlers, auth: TokenChecker, poller: IdlePoller) -> None:
        self._handlers = handlers
        self._auth = auth
        self._poller = poller
        self._fd = -1
        self._authed = not auth.required
        self._handshake = auth.handshake("rpc")  # the token's challenge-response (common/auth.py)
        # Bounded per connection by what the largest legal request can need (limits.py), so a peer that
        # announces a huge frame cannot make the master buffer it.
        self._max_payload = max_request_payload(handlers.config)
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._peer: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        self._peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._fd = sock.fileno()
            self._poller.add(self._fd)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._fd >= 0:
            self._poller.remove(self._fd)
            self._fd = -1

    def pause_writing(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self._poller.request_arrived()
        self._receive(data)
        self._poller.linger()  # the next request of a caller calling back to back is answered sooner

    def _receive(self, data: bytes) -> None:
        buf = self._buffer
        consumed = 0
        try:
            if not buf and self._authed and self._one_whole_frame(data):
                return
            buf += data
            while len(buf) - consumed >= frames.HEADER_SIZE:
                head = frames.unpack_header(memoryview(buf)[consumed : consumed + frames.HEADER_SIZE])
                if not self._authed and not self._may_precede_auth(head):
                    return  # refused before its payload is buffered: a peer without the token costs ~nothing
                if head.length > self._max_payload:
                    raise KvPoolError(ErrorCode.BAD_FRAME, f"payload of {head.length} bytes")
                end = consumed + frames.HEADER_SIZE + head.length
                if len(buf) < end:
                    break
                payload = bytes(buf[consumed + frames.HEADER_SIZE : end])
                consumed = end
                if not self._answer(head, payload):
                    self._close()
                    return
        except KvPoolError as exc:
            log.warning("closing RPC connection from %s: %s", self._peer, exc)
            self._close()
            return
        except Exception as exc:  # a malformed protobuf or a bug: close this connection only
            log.warning("closing RPC connection from %s: %s: %s", self._peer, type(exc).__name__, exc)
            self._close()
            return
        del buf[:consumed]

    def _one_whole_frame(self, data: bytes) -> bool:
        """The common case - one complete request in one read, nothing buffered - answered without copying
        it into the buffer; False leaves ``data`` to the general path."""
        if len(data) < frames.HEADER_SIZE:
            return False
        head = frames.unpack_header(data[: frames.HEADER_SIZE])
        if head.length > self._max_payload or len(data) != frames.HEADER_SIZE + head.length:
            return False
        if not self._answer(head, data[frames.HEADER_SIZE :]):
            self._close()
        return True

    def _may_precede_auth(self, head: frames.Header) -> bool:
        """Before a valid HELLO only HELLO and PING, with at most a token's worth of payload, are read;
        anything else is answered AUTH_FAILED (BAD_FRAME for an oversize HELLO) and the connection closed."""
        if head.op in (frames.Op.HELLO, frames.Op.PING) and head.length <= _MAX_PREAUTH_PAYLOAD:
            return True
        if head.op in (frames.Op.HELLO, frames.Op.PING):
            self._reply(head, code=ErrorCode.BAD_FRAME)
        else:
            self._auth.refuse("rpc")
            self._reply(head, code=ErrorCode.AUTH_FAILED)
        self._close()
        return False

    def _reply(self, head: frames.Header, body: bytes = b"", code: ErrorCode = ErrorCode.OK) -> None:
        assert self._transport is not None
        self._transport.write(frames.pack_header(head.op, head.req_id, len(body), int(code)) + body)

    def _answer(self, head: frames.Header, payload: bytes) -> bool:
        """Answer one request; False means: close the connection after the reply."""
        if head.op == frames.Op.PING:
            self._reply(head)
            return True
        if head.op == frames.Op.HELLO:
            code, body, why = self._handshake.answer(payload)
            self._authed = self._handshake.done
            self._reply(head, body, code)
            if code != ErrorCode.OK:
                log.warning("refusing RPC connection from %s: %s: %s", self._peer, code.name, why)
            return code == ErrorCode.OK
        method = frames.RPC_METHODS.get(head.op)
        if method is None:
            self._reply(head, code=ErrorCode.UNKNOWN_OP)
            return False
        if not self._authed:
            self._auth.refuse("rpc")
            self._reply(head, code=ErrorCode.AUTH_FAILED)
            return False
        name, request_type, response_type = method
        request = request_type.FromString(payload)  # type: ignore[attr-defined]
        self._reply(head, self._handlers.dispatch(name, request, response_type).SerializeToString())
        return True

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._buffer.clear()


class FramedRpcServer:
    """The lean hot path: the framed protocol carrying the same protobuf messages as gRPC."""

    def __init__(self, handlers: MasterHandlers, auth: TokenChecker) -> None:
        self._handlers = handlers
        self._auth = auth
        self._poller = IdlePoller(handlers.config.spin_us / 1e6)
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _FramedRpcProtocol(self._handlers, self._auth, self._poller), host, port
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._poller.close()


class Maintenance(threading.Thread):
    """Periodic work outside the request path: eviction above the watermark, store expiry, put reclaim."""

    def __init__(self, state: MasterState, config: MasterConfig, role: Role) -> None:
        super().__init__(name="master-maintenance", daemon=True)
        self.state = state
        self._config = config
        self._role = role
        self._stop = threading.Event()

    def run(self) -> None:
        next_slow = 0.0
        progress = self.state.tiers.progress  # demotions finished or puts wait for them: evict at once
        while not self._stop.is_set():
            progress.wait(self._config.eviction_interval_s)
            progress.clear()
            if self._stop.is_set():
                break
            if not self._role.serving:
                continue
            state = self.state
            try:
                if state.needs_eviction():
                    report = state.evict()
                    log.debug("evicted %d objects (%d bytes)", report.objects, report.bytes)
                state.tiers.maintain()  # SSD tier: overdue tasks, SSD watermark
                now = time.monotonic()
                if now >= next_slow:
                    next_slow = now + 1.0
                    for store in state.expire_stores():
                        log.warning("store %s expired: no heartbeat for %.1f s", store, self._config.store_ttl_s)
                    state.reclaim_abandoned_puts()
            except Exception:
                log.exception("maintenance pass failed")

    def stop(self) -> None:
        self._stop.set()
        self.state.tiers.progress.set()


class MasterServer:
    """A running master: gRPC + framed RPC + metrics + maintenance around one MasterState."""

    def __init__(self, config: MasterConfig, state: MasterState | None = None, role: Role | None = None) -> None:
        self.config = config
        self.state = state or MasterState(config)
        self.role = role or Role()
        self.endpoints: dict[str, str] = {}
        self.handlers = MasterHandlers(self.state, config, self.role, self.endpoints)
        self._auth = TokenChecker.from_file(config.token_file)
        self.handlers.registry.register(self._auth.collector("master"))
        self._grpc: grpc.aio.Server | None = None
        self._framed = FramedRpcServer(self.handlers, self._auth)
        self._metrics: MetricsServer | None = None
        self._maintenance = Maintenance(self.state, config, self.role)
        self._drain_controller = DrainController(self.handlers.drains)

    async def start(self) -> None:
        advertise = self.config.advertise or self.config.host
        self._grpc = grpc.aio.server(
            options=[("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)],
            interceptors=[self._auth.grpc_interceptor()] if self._auth.required else None,
        )
        pb_grpc.add_MasterServiceServicer_to_server(_make_servicer(self.handlers), self._grpc)  # type: ignore[no-untyped-call]
        address = f"{self.config.host}:{self.config.port}"
        credentials = tls.server_credentials(self.config.tls_cert, self.config.tls_key)
        if credentials is None:
            grpc_port = self._grpc.add_insecure_port(address)
        else:
            grpc_port = self._grpc.add_secure_port(address, credentials)
        if grpc_port == 0:
            raise KvPoolError(ErrorCode.UNAVAILABLE, f"cannot listen on {self.config.host}:{self.config.port}")
        await self._grpc.start()
        rpc_port = await self._framed.start(self.config.host, self.config.rpc_port)
        self.endpoints.update(grpc=f"{advertise}:{grpc_port}", rpc=f"{advertise}:{rpc_port}")
        if self.config.metrics_port >= 0:
            self._metrics = MetricsServer(
                self.config.host, self.config.metrics_port, self.handlers.registry, self._health
            ).start()
            self.endpoints["metrics"] = f"{advertise}:{self._metrics.port}"
        self._maintenance.start()
        self._drain_controller.start()
        log.info(
            "master serving: grpc %s, rpc %s, metrics %s",
            self.endpoints["grpc"],
            self.endpoints["rpc"],
            self.endpoints.get("metrics", "off"),
        )

    def reset_state(self) -> None:
        """Forget the whole index (a deposed leader): a later leadership rebuilds it from the stores."""
        listener = self.state.on_change  # the KV-event publisher (master/kv_events.py) stays attached
        self.state = MasterState(self.config)
        self.state.on_change = listener
        self.handlers.state = self.state
        self.handlers.collector.state = self.state
        self._maintenance.state = self.state
        self.handlers.drains.reset(self.state)  # drain jobs are reloaded from etcd by the next leadership
        self.handlers.standby.reset(self.state)

    def _health(self) -> tuple[bool, dict[str, Any]]:
        s = self.state.stats()
        return True, {
            "role": self.role.name,
            "view": self.role.view,
            "objects": s.objects,
            "segments": len(s.segments),
            "used": s.used,
            "capacity": s.capacity,
        }

    async def stop(self) -> None:
        self._maintenance.stop()
        self._drain_controller.stop()
        await self._framed.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace=0.5)
        if self._metrics is not None:
            self._metrics.stop()
