"""A small synchronous etcd v3 client: KV, compare-and-swap transactions, leases and resumable watches.

Why our own client: the maintained Python etcd clients either pin an old protobuf gencode, put proto
directories on ``sys.path``, or have no multi-endpoint failover (reference/environment.md, section 2).
This wrapper drives the vendored stubs in ``kvpool.proto.etcd``.

Failure model (the lessons of Mooncake's HA, e.g. its issue #2253 where a frozen etcd member hung the master):

* One gRPC channel per member. Calls stay on one member while it answers; an attempt that fails there
  (refused, no raft leader, or no answer in time) moves the call to the next member and quarantines the
  failed one for a while (see ``_EndpointSet`` for why this is not gRPC's round_robin).
* EVERY call carries a deadline. A call is split into attempts of at most ``attempt_timeout`` seconds inside
  the call's total budget (``timeout``): an attempt that lands on a SIGSTOPped member (its TCP connection
  looks healthy, it just never answers) times out and the retry goes to another member.
* Watches are long-lived streams and cannot carry a deadline; instead a watch sends a progress request
  every ``watch_liveness/2`` seconds and treats a stream that stayed silent for ``watch_liveness`` seconds as
  dead. It then resumes from the last revision it delivered + 1 on another member.
* Every failure reaches the caller as ``KvPoolError(ErrorCode.ETCD_ERROR, ...)``.

The client is thread-safe; all methods block (the master runs them in an executor).
"""

from __future__ import annotations

import ipaddress
import math
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import grpc

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger
from kvpool.proto.etcd import kv_pb2, rpc_pb2, rpc_pb2_grpc

__all__ = [
    "EtcdClient",
    "EventType",
    "KeyValue",
    "LeaseKeeper",
    "MemberStatus",
    "WatchEvent",
    "Watcher",
    "cluster_prefix",
    "parse_endpoints",
    "prefix_range_end",
    "validate_cluster_name",
]

log = get_logger(__name__)

T = TypeVar("T")

# etcd refuses requests on a member that has lost its raft leader when this is set, instead of serving
# stale data or hanging; clientv3 sets the same metadata on its watch streams ("hasleader").
_METADATA = (("hasleader", "true"),)

# Transient by nature: no connection, member restarting, leader election, per-attempt deadline.
_RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # "etcdserver: too many requests"
        grpc.StatusCode.ABORTED,
    }
)

_PAGE_SIZE = 1000
_MAX_MESSAGE = 64 * 1024 * 1024


class _StreamEnded(Exception):
    """A stream closed without the response we waited for (member shutting down): retry elsewhere."""


# --------------------------------------------------------------------------------------------------------
# Small value types
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd stores it. ``key`` is UTF-8 text (undecodable bytes are surrogate-escaped)."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @staticmethod
    def from_pb(kv: kv_pb2.KeyValue) -> KeyValue:
        return KeyValue(
            key=_decode_key(kv.key),
            value=bytes(kv.value),
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            version=kv.version,
            lease=kv.lease,
        )


class EventType(Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change of one key. For a DELETE, ``kv`` holds the key and ``mod_revision`` = the deletion revision.

    ``synthetic`` events do not come from etcd's event log: the watcher made them from a fresh read, at the
    start of a watch without a start revision or after the revisions it needed were compacted.
    """

    type: EventType
    kv: KeyValue
    synthetic: bool = False

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


@dataclass(frozen=True, slots=True)
class MemberStatus:
    member_id: int
    leader_id: int
    revision: int
    raft_term: int
    version: str


# --------------------------------------------------------------------------------------------------------
# Helpers: keys, endpoints
# --------------------------------------------------------------------------------------------------------


def _encode_key(key: str | bytes) -> bytes:
    return key if isinstance(key, bytes) else key.encode("utf-8", "surrogateescape")


def _decode_key(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def _encode_value(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix`` (etcd's GetPrefixRangeEnd)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # every key


def validate_cluster_name(cluster: str) -> str:
    """Cluster names become etcd key components: keep them to a safe alphabet."""
    if not cluster or not all(c.isalnum() or c in "-_." for c in cluster):
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"bad cluster name {cluster!r}: use [A-Za-z0-9._-]+")
    return cluster


def cluster_prefix(cluster: str) -> str:
    """``/kvpool/<cluster>/``: every key kvpool keeps in etcd lives under it."""
    return f"/kvpool/{validate_cluster_name(cluster)}/"


def parse_endpoints(endpoints: Sequence[str] | str) -> list[str]:
    """Normalise ``"h1:p1,h2:p2"``, ``"h1:p1;h2:p2"`` or a list (``http://`` allowed) to ``["h:p", ...]``."""
    items = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    out: list[str] = []
    for item in items:
        for part in item.replace(";", ",").split(","):
            part = part.strip()
            if not part:
                continue
            for scheme in ("http://", "https://"):
                if part.lower().startswith(scheme):
                    part = part[len(scheme) :]
            part = part.rstrip("/")
            _split_host_port(part)  # validates
            out.append(part)
    if not out:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"no etcd endpoints in {endpoints!r}")
    return out


def _split_host_port(endpoint: str) -> tuple[str, int]:
    host, sep, port_s = endpoint.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"bad endpoint {endpoint!r}: expected host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_s)


def _is_ip(host: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(host).version == version
    except ValueError:
        return False


def _channel_target(endpoint: str) -> str:
    """gRPC target of one member: a literal address, or a name for gRPC's re-resolving DNS resolver."""
    host, port = _split_host_port(endpoint)
    if _is_ip(host, 4):
        return f"ipv4:{host}:{port}"
    if _is_ip(host, 6):
        return f"ipv6:[{host}]:{port}"
    return f"dns:///{host}:{port}"


class _Endpoint:
    """One etcd member: its own channel and stubs, and a quarantine after failures."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.target = _channel_target(address)
        self.channel = grpc.insecure_channel(self.target, options=_channel_options())
        stubs: Any = rpc_pb2_grpc  # generated without annotations: treat the stubs as untyped on purpose
        self.kv: Any = stubs.KVStub(self.channel)
        self.lease: Any = stubs.LeaseStub(self.channel)
        self.watch: Any = stubs.WatchStub(self.channel)
        self.maint: Any = stubs.MaintenanceStub(self.channel)
        self.failures = 0  # consecutive
        self.suspect_until = 0.0  # monotonic; skipped until then while another member is available


class _EndpointSet:
    """Chooses the member for the next attempt: stay on one healthy member, move on when it fails.

    Why not one channel with every address and gRPC's round_robin: a SIGSTOPped member keeps its TCP
    connections looking healthy (the kernel even accepts new ones), so round_robin keeps giving it a share of
    the calls forever, each paying a full attempt timeout (measured: every third call, for as long as the
    member stayed frozen, keepalive or not). Here a member that failed an attempt is quarantined (1 s,
    doubling while it keeps failing, up to 30 s) and not used while another one is available.
    """

    _BASE_COOLDOWN = 1.0
    _MAX_COOLDOWN = 30.0

    def __init__(self, addresses: list[str]) -> None:
        self.members = [_Endpoint(a) for a in addresses]
        self._lock = threading.Lock()
        # Clients start on different members so that a fleet spreads its load.
        self._current = random.randrange(len(self.members))

    def pick(self) -> _Endpoint:
        now = time.monotonic()
        with self._lock:
            n = len(self.members)
            for i in range(n):
                ep = self.members[(self._current + i) % n]
                if ep.suspect_until <= now:
                    self._current = (self._current + i) % n
                    return ep
            # Everyone is quarantined: try the one whose quarantine ends first.
            ep = min(self.members, key=lambda m: m.suspect_until)
            self._current = self.members.index(ep)
            return ep

    def any_available(self) -> bool:
        now = time.monotonic()
        return any(ep.suspect_until <= now for ep in self.members)

    def failed(self, ep: _Endpoint, why: str) -> None:
        with self._lock:
            cooldown = min(self._MAX_COOLDOWN, self._BASE_COOLDOWN * 2.0 ** min(ep.failures, 8))
            ep.failures += 1
            ep.suspect_until = time.monotonic() + cooldown
        log.info("etcd member %s failed (%s); avoiding it for %.0fs", ep.address, why, cooldown)

    def succeeded(self, ep: _Endpoint) -> None:
        if ep.failures:
            with self._lock:
                ep.failures = 0
                ep.suspect_until = 0.0

    def close(self) -> None:
        for ep in self.members:
            ep.channel.close()


# --------------------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------------------


class EtcdClient:
    """Blocking etcd v3 client with failover between members; see the module docstring for the model.

    ``timeout`` is the total budget of one call (all its attempts); ``attempt_timeout`` bounds one attempt
    (default ``max(0.5, timeout / 3)``), which is how long a frozen member can delay a call before the retry
    moves on. ``watch_liveness`` is how long a watch stream may stay silent before it is replaced.
    """

    def __init__(
        self,
        endpoints: Sequence[str] | str,
        timeout: float = 5.0,
        *,
        attempt_timeout: float | None = None,
        watch_liveness: float = 3.0,
    ) -> None:
        if timeout <= 0:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"etcd timeout must be positive, got {timeout}")
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = float(timeout)
        self.attempt_timeout = min(self.timeout, attempt_timeout or max(0.5, self.timeout / 3))
        self.watch_liveness = float(watch_liveness)
        self._members = _EndpointSet(self.endpoints)
        self._closed = False
        self._children: weakref.WeakSet[Watcher | LeaseKeeper] = weakref.WeakSet()
        self._children_lock = threading.Lock()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(self.endpoints)!r})"

    # ---- the retry core --------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[_Endpoint, float], T], timeout: float | None = None) -> tuple[T, bool]:
        """Run ``fn(member, attempt_timeout_s)`` until it succeeds or the call's budget is spent.

        Returns ``(result, ambiguous)``: ``ambiguous`` is True when an earlier attempt failed in a way that
        may still have been applied (a timeout), so that a write's caller can reconcile a failed compare.
        """
        if self._closed:
            raise KvPoolError(ErrorCode.ETCD_ERROR, f"etcd {what}: client is closed")
        budget = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + budget
        ambiguous = False
        last_error = "no attempt made"
        backoff = 0.02
        while (remaining := deadline - time.monotonic()) > 0.001:
            ep = self._members.pick()
            try:
                result = fn(ep, min(remaining, self.attempt_timeout))
                self._members.succeeded(ep)
                return result, ambiguous
            except grpc.RpcError as e:
                code = e.code()
                last_error = f"{code.name}: {e.details()} ({ep.address})"
                if code not in _RETRYABLE or self._closed:
                    raise KvPoolError(ErrorCode.ETCD_ERROR, f"etcd {what}: {last_error}") from None
                ambiguous = ambiguous or not _surely_not_applied(code, str(e.details()))
            except _StreamEnded as e:
                last_error = f"{e} ({ep.address})"
            self._members.failed(ep, last_error)
            if self._members.any_available():
                continue  # another member may answer at once
            # Every member failed lately (no quorum, election, all down): back off instead of spinning.
            time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, 0.5)
        raise KvPoolError(ErrorCode.ETCD_ERROR, f"etcd {what}: no answer within {budget:.2f}s ({last_error})")

    def _unary(
        self, what: str, method: Callable[[_Endpoint], Any], request: Any, timeout: float | None
    ) -> tuple[Any, bool]:
        return self._call(what, lambda ep, t: method(ep)(request, timeout=t, metadata=_METADATA), timeout)

    # ---- KV ----------------------------------------------------------------------------------------------

    def read(
        self, key: str | bytes, *, prefix: bool = False, timeout: float | None = None
    ) -> tuple[list[KeyValue], int]:
        """Linearizable read of one key or a prefix; returns the KVs and the revision they were read at.

        A prefix is read in pages at one fixed revision, so the result is one consistent snapshot. Watch
        from ``revision + 1`` to continue without a gap.
        """
        k = _encode_key(key)
        end = prefix_range_end(k) if prefix else b""
        out: list[KeyValue] = []
        revision = 0
        start = k
        while True:
            req = rpc_pb2.RangeRequest(
                key=start,
                range_end=end,
                revision=revision,
                limit=_PAGE_SIZE if prefix else 0,
                sort_order=rpc_pb2.RangeRequest.ASCEND if prefix else rpc_pb2.RangeRequest.NONE,
                sort_target=rpc_pb2.RangeRequest.KEY,
            )
            resp, _ = self._unary("range", lambda ep: ep.kv.Range, req, timeout)
            revision = revision or resp.header.revision
            out.extend(KeyValue.from_pb(kv) for kv in resp.kvs)
            if not (prefix and resp.more and resp.kvs):
                return out, revision
            start = bytes(resp.kvs[-1].key) + b"\x00"

    def get(self, key: str | bytes, *, timeout: float | None = None) -> KeyValue | None:
        kvs, _ = self.read(key, timeout=timeout)
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: str | bytes, *, timeout: float | None = None) -> list[KeyValue]:
        kvs, _ = self.read(prefix, prefix=True, timeout=timeout)
        return kvs

    def put(self, key: str | bytes, value: str | bytes, lease: int = 0, *, timeout: float | None = None) -> int:
        """Unconditional put; returns the revision of the write."""
        req = rpc_pb2.PutRequest(key=_encode_key(key), value=_encode_value(value), lease=lease)
        resp, _ = self._unary("put", lambda ep: ep.kv.Put, req, timeout)
        return int(resp.header.revision)

    def delete(self, key: str | bytes, *, prefix: bool = False, timeout: float | None = None) -> bool:
        """Delete a key (or every key under a prefix); True if anything was deleted."""
        k = _encode_key(key)
        req = rpc_pb2.DeleteRangeRequest(key=k, range_end=prefix_range_end(k) if prefix else b"")
        resp, ambiguous = self._unary("delete", lambda ep: ep.kv.DeleteRange, req, timeout)
        # A retried delete finds nothing the second time: the first attempt may have done it.
        return resp.deleted > 0 or ambiguous

    def compact(self, revision: int, *, physical: bool = True, timeout: float | None = None) -> None:
        """Compact the key-value history up to ``revision`` (operations and tests)."""
        req = rpc_pb2.CompactionRequest(revision=revision, physical=physical)
        self._unary("compact", lambda ep: ep.kv.Compact, req, timeout)

    # ---- transactions ------------------------------------------------------------------------------------

    def _txn_put_if(
        self, what: str, cmp: rpc_pb2.Compare, key: bytes, value: bytes, lease: int, timeout: float | None
    ) -> tuple[bool, int, KeyValue | None, bool]:
        """``if cmp then put(key, value, lease) else get(key)``: (succeeded, revision, current, ambiguous)."""
        req = rpc_pb2.TxnRequest(
            compare=[cmp],
            success=[rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))],
            failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))],
        )
        resp, ambiguous = self._unary(what, lambda ep: ep.kv.Txn, req, timeout)
        revision = int(resp.header.revision)
        if resp.succeeded:
            return True, revision, None, ambiguous
        kvs = resp.responses[0].response_range.kvs if resp.responses else []
        return False, revision, (KeyValue.from_pb(kvs[0]) if kvs else None), ambiguous

    def create_if_absent(
        self, key: str | bytes, value: str | bytes, lease: int = 0, *, timeout: float | None = None
    ) -> tuple[bool, int, KeyValue | None]:
        """Create ``key`` only if it does not exist (compare create_revision == 0).

        Returns ``(created, revision, existing)``: on success ``revision`` is the new key's create revision
        and ``existing`` is None; otherwise ``existing`` is the key that won. If a timed-out attempt did
        create the key and its retry lost the compare, the key found there carries our own lease and value,
        which is reported as our success (lease ids are unique, so this cannot claim someone else's key).
        """
        k, v = _encode_key(key), _encode_value(value)
        cmp = rpc_pb2.Compare(key=k, target=rpc_pb2.Compare.CREATE, result=rpc_pb2.Compare.EQUAL, create_revision=0)
        ok, revision, existing, _ = self._txn_put_if("create_if_absent", cmp, k, v, lease, timeout)
        if ok:
            return True, revision, None
        if existing is not None and lease != 0 and existing.lease == lease and existing.value == v:
            return True, existing.create_revision, None
        return False, revision, existing

    def put_if_mod_revision(
        self,
        key: str | bytes,
        expected_mod_revision: int,
        value: str | bytes,
        lease: int = 0,
        *,
        timeout: float | None = None,
    ) -> tuple[bool, int, KeyValue | None]:
        """Compare-and-put on the key's mod_revision (0 = the key must be absent).

        Returns ``(succeeded, revision, current)`` like :meth:`create_if_absent`; on success ``revision``
        is the revision of this write (the key's new mod_revision).
        """
        k, v = _encode_key(key), _encode_value(value)
        cmp = rpc_pb2.Compare(
            key=k,
            target=rpc_pb2.Compare.MOD,
            result=rpc_pb2.Compare.EQUAL,
            mod_revision=expected_mod_revision,
        )
        ok, revision, current, ambiguous = self._txn_put_if("compare_and_put", cmp, k, v, lease, timeout)
        if ok:
            return True, revision, None
        if (
            ambiguous
            and current is not None
            and current.mod_revision > expected_mod_revision
            and current.value == v
            and current.lease == lease
        ):
            # Our timed-out first attempt was applied; the retry saw our own write.
            return True, current.mod_revision, None
        return False, revision, current

    def compare_and_put(
        self,
        key: str | bytes,
        expected_mod_revision: int,
        value: str | bytes,
        lease: int = 0,
        *,
        timeout: float | None = None,
    ) -> bool:
        """Put only if the key's mod_revision is still ``expected_mod_revision`` (0 = absent)."""
        ok, _, _ = self.put_if_mod_revision(key, expected_mod_revision, value, lease, timeout=timeout)
        return ok

    def _delete_if(self, what: str, cmp: rpc_pb2.Compare, key: bytes, timeout: float | None) -> bool:
        req = rpc_pb2.TxnRequest(
            compare=[cmp],
            success=[rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key))],
        )
        resp, ambiguous = self._unary(what, lambda ep: ep.kv.Txn, req, timeout)
        if resp.succeeded:
            return True
        # After a timed-out attempt the compare fails on a key that attempt already deleted.
        return ambiguous and self.get(key, timeout=timeout) is None

    def delete_if(self, key: str | bytes, expected_create_revision: int, *, timeout: float | None = None) -> bool:
        """Delete ``key`` only if it is still the incarnation created at ``expected_create_revision``."""
        k = _encode_key(key)
        cmp = rpc_pb2.Compare(
            key=k,
            target=rpc_pb2.Compare.CREATE,
            result=rpc_pb2.Compare.EQUAL,
            create_revision=expected_create_revision,
        )
        return self._delete_if("delete_if", cmp, k, timeout)

    def delete_if_mod_revision(
        self, key: str | bytes, expected_mod_revision: int, *, timeout: float | None = None
    ) -> bool:
        """Delete ``key`` only if nobody wrote it since ``expected_mod_revision``."""
        k = _encode_key(key)
        cmp = rpc_pb2.Compare(
            key=k,
            target=rpc_pb2.Compare.MOD,
            result=rpc_pb2.Compare.EQUAL,
            mod_revision=expected_mod_revision,
        )
        return self._delete_if("delete_if_mod_revision", cmp, k, timeout)

    # ---- leases ------------------------------------------------------------------------------------------

    def _grant(self, ttl_s: float, timeout: float | None = None) -> tuple[int, int]:
        """Grant a lease; returns (id, granted TTL). etcd TTLs are whole seconds and the server may raise
        a short TTL to its minimum (1.5 election timeouts), so callers must use the granted value."""
        req = rpc_pb2.LeaseGrantRequest(TTL=max(1, math.ceil(ttl_s)))
        resp, _ = self._unary("lease_grant", lambda ep: ep.lease.LeaseGrant, req, timeout)
        if resp.error:
            raise KvPoolError(ErrorCode.ETCD_ERROR, f"etcd lease_grant: {resp.error}")
        return int(resp.ID), int(resp.TTL)

    def lease_grant(self, ttl_s: float, *, timeout: float | None = None) -> int:
        """Grant a lease of ``ceil(ttl_s)`` seconds (at least etcd's minimum); returns its id."""
        return self._grant(ttl_s, timeout)[0]

    def lease_revoke(self, lease_id: int, *, timeout: float | None = None) -> None:
        """Revoke a lease, deleting its keys at once. Revoking an unknown or expired lease is not an error."""
        req = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        try:
            self._unary("lease_revoke", lambda ep: ep.lease.LeaseRevoke, req, timeout)
        except KvPoolError as e:
            if "NOT_FOUND" not in e.message:
                raise

    def lease_keepalive_once(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Renew a lease once; returns the TTL left in seconds (0 = the lease is gone: expired or revoked)."""
        req = rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)

        def attempt(ep: _Endpoint, t: float) -> int:
            stream = ep.lease.LeaseKeepAlive(iter([req]), timeout=t, metadata=_METADATA)
            try:
                resp = next(stream, None)
            finally:
                stream.cancel()
            if resp is None:
                raise _StreamEnded("lease keepalive stream closed without an answer")
            return int(resp.TTL)

        ttl, _ = self._call("lease_keepalive", attempt, timeout)
        return max(0, ttl)

    def lease_time_to_live(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Whole seconds left on a lease, without renewing it; -1 if the lease does not exist (any more)."""
        req = rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id)
        resp, _ = self._unary("lease_ttl", lambda ep: ep.lease.LeaseTimeToLive, req, timeout)
        return max(-1, int(resp.TTL))

    # ---- watches and status ------------------------------------------------------------------------------

    def watch(
        self,
        key_or_prefix: str | bytes,
        start_revision: int | None,
        callback: Callable[[WatchEvent], None],
        *,
        prefix: bool = False,
        on_resync: Callable[[list[KeyValue], int], None] | None = None,
    ) -> Watcher:
        """Watch a key (or prefix) from ``start_revision`` in a daemon thread; see :class:`Watcher`.

        ``start_revision`` None or <= 0 means: read the current state first, deliver it as synthetic events,
        then watch from the revision of that read + 1 (list-then-watch without a gap).
        """
        watcher = Watcher(self, _encode_key(key_or_prefix), prefix, start_revision, callback, on_resync)
        self._adopt(watcher)
        watcher.start()
        return watcher

    def status(self, *, timeout: float | None = None) -> MemberStatus:
        """Status of whichever member answers (round robin): its id, its view of the raft leader, revision."""
        resp, _ = self._unary("status", lambda ep: ep.maint.Status, rpc_pb2.StatusRequest(), timeout)
        return MemberStatus(
            member_id=int(resp.header.member_id),
            leader_id=int(resp.leader),
            revision=int(resp.header.revision),
            raft_term=int(resp.raftTerm),
            version=str(resp.version),
        )

    def _adopt(self, child: Watcher | LeaseKeeper) -> None:
        with self._children_lock:
            self._children.add(child)

    def close(self) -> None:
        """Stop this client's watchers and lease keepers (leases are left to expire), close the channel."""
        if self._closed:
            return
        with self._children_lock:
            children = list(self._children)
        for child in children:
            if isinstance(child, Watcher):
                child.stop()
            else:
                child.stop(revoke=False)
        self._closed = True
        self._members.close()


def _surely_not_applied(code: grpc.StatusCode, details: str) -> bool:
    """True for failures that prove the request never reached raft (no connection, no leader)."""
    text = details.lower()
    return code is grpc.StatusCode.UNAVAILABLE and ("connect" in text or "no leader" in text)


def _channel_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.lb_policy_name", "round_robin"),
        # Keepalive pings only while calls are active, and no more often than etcd's enforcement minimum
        # (--grpc-keepalive-min-time, 5 s): otherwise etcd answers with GOAWAY "too_many_pings".
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 3_000),
        ("grpc.keepalive_permit_without_calls", 0),
        # A restarted member should rejoin the rotation quickly.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        ("grpc.max_receive_message_length", _MAX_MESSAGE),
        ("grpc.max_send_message_length", _MAX_MESSAGE),
    ]


# --------------------------------------------------------------------------------------------------------
# Lease keeper
# --------------------------------------------------------------------------------------------------------


class LeaseKeeper:
    """Grants a lease and keeps it alive from a daemon thread; reports its loss once through ``on_lost``.

    Renewals run every TTL/3. The keeper tracks a conservative local expiry: the time a successful renewal
    was *sent* plus the TTL the server returned (the server restarted its timer later than that). The lease
    counts as lost when that expiry passes without a renewal (etcd unreachable, or this process was frozen)
    or when the server says the lease is gone. A holder that reacts to ``on_lost`` therefore stops acting on
    the lease no later than etcd expires it, as long as this process keeps running.
    """

    def __init__(
        self,
        client: EtcdClient,
        ttl: float,
        on_lost: Callable[[], None] | None = None,
        *,
        name: str = "lease",
    ) -> None:
        self._client = client
        self._requested_ttl = ttl
        self._on_lost = on_lost
        self._name = name
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread: threading.Thread | None = None
        self.lease_id = 0
        self.ttl = 0  # granted, whole seconds
        self._expiry = 0.0  # monotonic
        self._gone = False  # etcd said the lease no longer exists

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def expires_in(self) -> float:
        """Seconds until the local (conservative) expiry estimate."""
        return self._expiry - time.monotonic()

    def start(self) -> int:
        """Grant the lease and start renewing it; returns the lease id (KvPoolError if the grant fails)."""
        if self._thread is not None:
            raise KvPoolError(ErrorCode.INTERNAL, "LeaseKeeper.start() called twice")
        sent = time.monotonic()
        self.lease_id, self.ttl = self._client._grant(self._requested_ttl)
        self._expiry = sent + self.ttl
        self._client._adopt(self)
        self._thread = threading.Thread(target=self._run, name=f"etcd-{self._name}-{self.lease_id:x}", daemon=True)
        self._thread.start()
        return self.lease_id

    def wait_lost(self, timeout: float | None = None) -> bool:
        return self._lost.wait(timeout)

    def stop(self, revoke: bool = True, *, timeout: float | None = None) -> None:
        """Stop renewing; with ``revoke`` also revoke the lease (its keys vanish at once). Never raises."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._client.timeout + 1.0)
        # A lease lost to silence may still live on the server: revoking it frees its keys sooner.
        if revoke and self.lease_id and not self._gone:
            try:
                self._client.lease_revoke(self.lease_id, timeout=timeout)
            except KvPoolError as e:
                log.warning("could not revoke lease %x (it will expire in <= %ds): %s", self.lease_id, self.ttl, e)

    def _run(self) -> None:
        interval = self.ttl / 3.0
        retry = min(0.2, interval)
        next_renewal = time.monotonic() + interval
        while True:
            wake = min(next_renewal, self._expiry)
            if self._stop.wait(max(0.0, wake - time.monotonic())):
                return
            sent = time.monotonic()
            if sent >= self._expiry:
                self._lose(f"no successful renewal for {self.ttl}s")
                return
            try:
                # Never wait past the local expiry: the loss must be reported on time.
                left = self._client.lease_keepalive_once(self.lease_id, timeout=max(0.05, self._expiry - sent))
            except KvPoolError as e:
                log.warning("lease %x renewal failed (%.2fs left): %s", self.lease_id, self._expiry - sent, e)
                next_renewal = time.monotonic() + retry
                continue
            if self._stop.is_set():
                return
            if left <= 0:
                self._gone = True
                self._lose("etcd says the lease is gone (expired or revoked)")
                return
            self._expiry = sent + left
            next_renewal = sent + interval

    def _lose(self, why: str) -> None:
        if self._stop.is_set():
            return
        log.warning("lease %x (%s) lost: %s", self.lease_id, self._name, why)
        self._lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                log.exception("on_lost callback of lease %x failed", self.lease_id)


# --------------------------------------------------------------------------------------------------------
# Watcher
# --------------------------------------------------------------------------------------------------------


class _Resync(Exception):
    """The revisions the watch needs were compacted away: re-read the current state."""


class Watcher:
    """A watch that survives member failures; created by :meth:`EtcdClient.watch`.

    Events are delivered in revision order, each exactly once, from one daemon thread (keep callbacks
    short). After a stream error it resumes from the last delivered revision + 1 on any member. If that
    revision was compacted, it re-reads the current state and delivers it as synthetic events (or through
    ``on_resync(kvs, revision)`` when given; a prefix watcher that must notice keys deleted during the gap
    should use it), then continues from there.
    """

    def __init__(
        self,
        client: EtcdClient,
        key: bytes,
        prefix: bool,
        start_revision: int | None,
        callback: Callable[[WatchEvent], None],
        on_resync: Callable[[list[KeyValue], int], None] | None,
    ) -> None:
        self._client = client
        self._key = key
        self._range_end = prefix_range_end(key) if prefix else b""
        self._prefix = prefix
        self._callback = callback
        self._on_resync = on_resync
        self._next_rev: int | None = start_revision if start_revision and start_revision > 0 else None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._requests: queue.Queue[rpc_pb2.WatchRequest | None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch-{_decode_key(key)}", daemon=True)
        self.member_id = 0  # etcd id of the member serving the current stream (from response headers)
        self.endpoint = ""  # address of that member
        self.streams = 0  # streams opened so far (1 + reconnects)
        self.resyncs = 0
        self._synced = threading.Event()
        self._created = False  # the current stream's watch was created

    @property
    def revision(self) -> int:
        """The last revision delivered (or read at a resync); 0 before anything."""
        return (self._next_rev or 1) - 1

    def start(self) -> None:
        self._thread.start()

    def wait_started(self, timeout: float) -> bool:
        """Wait until the first stream is established (its ``created`` answer arrived)."""
        return self._synced.wait(timeout)

    def stop(self) -> None:
        """Stop watching; no callback runs after this returns (unless called from a callback)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._cancel_stream()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._client.timeout + 2.0)

    # ---- the loop -----------------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.05
        while not self._stopped.is_set():
            try:
                if self._next_rev is None:
                    self._resync()
                if self._stream(self._next_rev or 1):
                    backoff = 0.05
                    continue  # replaced a silent or failed stream that had worked: reconnect at once
            except _Resync:
                self.resyncs += 1
                self._next_rev = None
                continue
            except KvPoolError as e:
                log.warning("etcd watch on %r: %s", _decode_key(self._key), e)
            except Exception:
                log.exception("etcd watch on %r crashed; restarting it", _decode_key(self._key))
            if self._stopped.wait(backoff):
                return
            backoff = min(backoff * 2, 1.0)

    def _resync(self) -> None:
        kvs, revision = self._client.read(self._key, prefix=self._prefix)
        if self._stopped.is_set():
            return
        on_resync = self._on_resync
        if on_resync is not None:
            self._safe(lambda: on_resync(kvs, revision))
        else:
            for kv in kvs:
                self._deliver(WatchEvent(EventType.PUT, kv, synthetic=True))
            if not self._prefix and not kvs:
                gone = KeyValue(_decode_key(self._key), b"", 0, revision, 0, 0)
                self._deliver(WatchEvent(EventType.DELETE, gone, synthetic=True))
        self._next_rev = revision + 1

    def _stream(self, start_revision: int) -> bool:
        """Run one watch stream on one member; returns True if it was established before it ended."""
        requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
        create = rpc_pb2.WatchCreateRequest(key=self._key, range_end=self._range_end, start_revision=start_revision)
        requests.put(rpc_pb2.WatchRequest(create_request=create))
        last_rx = [time.monotonic()]
        ep = self._client._members.pick()
        with self._lock:
            if self._stopped.is_set():
                return False
            self._requests = requests
            self._call = ep.watch.Watch(self._request_iter(requests, last_rx), metadata=_METADATA)
            call = self._call
        self.endpoint = ep.address
        self.streams += 1
        self._created = False
        try:
            self._consume(call, start_revision, last_rx)
            why = "stream closed by the member"
        except grpc.RpcError as e:
            why = f"stream ended: {e.code().name}"
        except KvPoolError as e:
            why = e.message
        finally:
            self._cancel_stream()
        if not self._stopped.is_set():
            log.info("etcd watch on %r: %s; resuming at revision %s", _decode_key(self._key), why, self._next_rev)
            self._client._members.failed(ep, why)
        return self._created

    def _consume(self, call: Any, start_revision: int, last_rx: list[float]) -> None:
        """Deliver the events of one stream until it ends; raises _Resync when history was compacted."""
        watch_id: int | None = None
        for resp in call:
            last_rx[0] = time.monotonic()
            self.member_id = int(resp.header.member_id)
            if resp.created and watch_id is None:
                watch_id, self._created = resp.watch_id, True
                self._synced.set()
            if resp.compact_revision > 0:
                log.warning(
                    "etcd watch on %r: revision %d compacted (oldest kept %d); re-reading",
                    _decode_key(self._key),
                    start_revision,
                    resp.compact_revision,
                )
                raise _Resync()
            if resp.watch_id != watch_id:
                continue  # a progress answer (watch_id -1) only proves the stream is alive
            if resp.canceled:
                raise KvPoolError(ErrorCode.ETCD_ERROR, f"watch canceled by etcd: {resp.cancel_reason}")
            self._deliver_events(resp.events)

    def _request_iter(
        self, requests: queue.Queue[rpc_pb2.WatchRequest | None], last_rx: list[float]
    ) -> Iterator[rpc_pb2.WatchRequest]:
        """Feeds the stream: the create request, then a progress request every liveness/2 seconds.

        It runs in gRPC's request thread and doubles as the stream's watchdog: a stream that stayed silent
        for ``watch_liveness`` seconds (a frozen member) is cancelled so that the loop reconnects elsewhere.
        """
        liveness = self._client.watch_liveness
        progress = rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest())
        while True:
            try:
                item = requests.get(timeout=liveness / 2)
            except queue.Empty:
                if time.monotonic() - last_rx[0] > liveness:
                    log.warning(
                        "etcd watch on %r: member silent for %.1fs; reconnecting",
                        _decode_key(self._key),
                        liveness,
                    )
                    self._cancel_stream(requests)
                    return
                item = progress
            if item is None:
                return
            yield item

    def _cancel_stream(self, only: queue.Queue[rpc_pb2.WatchRequest | None] | None = None) -> None:
        with self._lock:
            if only is not None and only is not self._requests:
                return
            call, requests = self._call, self._requests
            self._call = self._requests = None
        if requests is not None:
            requests.put(None)  # unblocks the request iterator so gRPC's request thread can finish
        if call is not None:
            call.cancel()

    def _deliver_events(self, events: Sequence[kv_pb2.Event]) -> None:
        top = 0
        for ev in events:
            kv = KeyValue.from_pb(ev.kv)
            if self._next_rev is not None and kv.mod_revision < self._next_rev:
                continue  # already delivered before a reconnect
            kind = EventType.DELETE if ev.type == kv_pb2.Event.DELETE else EventType.PUT
            self._deliver(WatchEvent(kind, kv))
            top = max(top, kv.mod_revision)
        if top:
            # etcd sends all events of one revision in one response, so resuming at top + 1 loses nothing.
            self._next_rev = top + 1

    def _deliver(self, event: WatchEvent) -> None:
        if not self._stopped.is_set():
            self._safe(lambda: self._callback(event))

    def _safe(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:
            log.exception("etcd watch callback on %r failed", _decode_key(self._key))
