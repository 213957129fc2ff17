"""The parts the client's calls are made of: the caller's buffers (``Buffer``, ``ptr_view``, byte views),
per-call placement options (``PutConfig``), master requests carrying keys, the master's answers for keys to
read in plain Python (``_Resolved``), and the client's counters. Used by ``PoolClient`` (pool_client.py) and
its read and write paths (read_path.py, write_path.py).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.proto import master_pb2 as pb
from kvpool.transfer.base import Replica

R = TypeVar("R")

_FIRST_MAPPABLE_ADDRESS = 4096
"""Linux never maps the first page (vm.mmap_min_addr is at least this): a pointer below it is NULL plus a bit."""

Buffer = Any  # anything that exports the buffer protocol (bytes, bytearray, memoryview, numpy, torch.numpy())


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
