"""A small synchronous etcd v3 client: KV, compare-and-swap transactions, leases and resumable watches.

Why our own client: the maintained Python etcd clients either pin an old protobuf gencode, put proto
directories on ``sys.path``, or have no multi-endpoint failover.
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

This module holds the client and its retry core; its parts live beside it: ``etcd_types`` (value types,
key and endpoint helpers), ``etcd_members`` (channels and quarantine), ``etcd_lease`` (``LeaseKeeper``) and
``etcd_watch`` (``Watcher``). Import them all from here.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.etcd_lease import LeaseKeeper
from kvpool.common.etcd_members import _Endpoint, _EndpointSet
from kvpool.common.etcd_types import (
    _METADATA,
    EventType,
    KeyValue,
    MemberStatus,
    WatchEvent,
    _encode_key,
    _encode_value,
    cluster_prefix,
    parse_endpoints,
    prefix_range_end,
    validate_cluster_name,
)
from kvpool.common.etcd_watch import Watcher
from kvpool.common.log import get_logger
from kvpool.proto.etcd import rpc_pb2

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


class _StreamEnded(Exception):
    """A stream closed without the response we waited for (member shutting down): retry elsewhere."""


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

    def keep_lease(
        self, ttl_s: float, on_lost: Callable[[], None] | None = None, *, name: str = "lease"
    ) -> LeaseKeeper:
        """A :class:`LeaseKeeper` on this client, not yet started (the ``Coordinator`` way to hold a lease)."""
        return LeaseKeeper(self, ttl_s, on_lost, name=name)

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
