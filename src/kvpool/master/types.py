"""Plain dataclasses in and out of ``MasterState`` (no protobuf: the service layer maps them to the wire).

Result types built per key on the hot paths (``ReplicaGrant``, ``PutStartResult``, ``GetResult``) are mutable
slotted dataclasses: a frozen dataclass's ``__init__`` goes through ``object.__setattr__`` and costs about
twice as much. Treat them as read-only all the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.common.errors import ErrorCode
from kvpool.master.segments import SegmentStatus

__all__ = [
    "EvictionReport",
    "GetResult",
    "HeartbeatResult",
    "InventoryItem",
    "MasterStats",
    "MountResult",
    "PutOptions",
    "PutStartResult",
    "ReplicaGrant",
    "SegmentReport",
    "SegmentSpec",
]


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    """A segment as a store mounts it (MountSegmentRequest.segment + secret)."""

    id: int
    node: str
    store_id: str
    size: int
    tcp_endpoint: str
    shm_path: str
    secret: bytes
    rdma_desc: bytes = b""
    numa_node: int = -1
    tier: int = 0
    """0 = a DRAM segment; 1 = the store's SSD tier (readable over TCP only, never allocatable for puts)."""


@dataclass(frozen=True, slots=True)
class InventoryItem:
    """One committed object as its store knows it (used to rebuild the index after a failover)."""

    key: str
    offset: int
    length: int
    checksum: int
    tier: int = 0
    """0 = a DRAM segment, 1 = an SSD tier; an entry is adopted only into a segment of its own tier."""


@dataclass(frozen=True, slots=True)
class PutOptions:
    """Per-batch put options (PutConfig)."""

    replica_num: int = 0
    """0 = MasterConfig.default_replica_num. Best effort: the put succeeds with >= 1 replica."""
    hard_pin: bool = False
    soft_pin_ttl_s: float = 0.0
    """0 = no soft pin; the pin's deadline starts when the object becomes visible (put_end)."""
    preferred_segments: Sequence[int | str] = ()
    """Segment ids (int or decimal string) or node names, tried first in this order."""
    preferred_node: str = ""
    """Segments on this node are tried after ``preferred_segments`` and before the policy's order."""
    writer_node: str = ""
    """The writer's node (LocalFirst placement)."""


@dataclass(slots=True)
class ReplicaGrant:
    """Where one replica lives and the signed grant to READ or WRITE it (ReplicaDescriptor)."""

    segment_id: int
    node: str
    tcp_endpoint: str
    shm_path: str
    offset: int
    length: int
    expiry_ms: int
    """Wall-clock ms after which the store refuses the grant."""
    mac: bytes
    tier: int = 0


@dataclass(slots=True)
class PutStartResult:
    code: ErrorCode
    replicas: tuple[ReplicaGrant, ...] = ()
    """WRITE grants, one per allocated replica (empty unless code is OK)."""


@dataclass(slots=True)
class GetResult:
    code: ErrorCode
    size: int = 0
    checksum: int = 0
    lease_expiry_ms: int = 0
    """Wall-clock ms; a read that completes later must be discarded (LEASE_EXPIRED)."""
    replicas: tuple[ReplicaGrant, ...] = ()
    """READ grants of the readable replicas (expiry = lease expiry)."""


@dataclass(frozen=True, slots=True)
class MountResult:
    code: ErrorCode
    adopted: int = 0
    """Inventory entries taken into the index (including ones the master already had)."""
    rejected: int = 0
    """Inventory entries refused: malformed key, out of bounds, overlapping, conflicting size/checksum,
    unsupported tier."""


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    code: ErrorCode
    freed: list[tuple[int, int, int, str]] = field(default_factory=list)
    """(segment_id, offset, seq, key) of ranges the master freed and the store has not acknowledged yet;
    ``key`` is the object that held the range ("" when not known)."""


@dataclass(frozen=True, slots=True)
class EvictionReport:
    objects: int
    bytes: int
    scanned: int
    """Candidates collected in phase 1."""
    seconds: float
    keys: list[str] = field(default_factory=list)
    """The evicted keys in eviction order (for KV events, logs and tests)."""


@dataclass(frozen=True, slots=True)
class SegmentReport:
    """A segment as admin tools see it (SegmentInfo with used/objects)."""

    id: int
    node: str
    store_id: str
    size: int
    tcp_endpoint: str
    shm_path: str
    rdma_desc: bytes
    numa_node: int
    status: SegmentStatus
    used: int
    objects: int
    """Replicas on this segment (complete or in flight)."""
    largest_free: int = 0
    tier: int = 0


@dataclass(frozen=True, slots=True)
class MasterStats:
    objects: int
    """Visible (COMPLETE) objects."""
    capacity: int
    """Bytes of all mounted segments."""
    used: int
    hits: int
    misses: int
    evictions: int
    evicted_bytes: int
    puts: int
    """Puts completed (put_end)."""
    reclaimed_puts: int
    segments: list[SegmentReport]
    processing: int = 0
    """Puts in flight."""
    stores: int = 0
    allocatable_capacity: int = 0
    """Bytes of segments that take allocations (status OK): the watermark base."""
    allocatable_used: int = 0
    ssd_capacity: int = 0
    """Bytes of the mounted SSD tiers (not part of ``capacity``)."""
    ssd_used: int = 0
