"""The Transport interface: move object ranges between local buffers and store segments.

A transport moves a batch of READ/WRITE requests, each for one replica of one object, and reports one
ErrorCode per request. Implementations: ``tcp`` (everywhere), ``shm`` (same node: the segment is
mapped, a transfer is a memcpy), ``rdma`` (pyverbs, one-sided READ/WRITE into registered memory).
The client picks one per replica (:mod:`kvpool.transfer.registry`).

Every request carries the master's grant (``Replica.mac``/``expiry_ms``); the store verifies it, so a
transport never needs to trust the caller's offsets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from kvpool.common.checksum import LazyChecksum, checksum, checksum_value
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import Grant, GrantOp
from kvpool.proto import master_pb2 as pb


class Replica(NamedTuple):
    """Where one copy of an object lives, and the grant to touch it (from the master).

    Named tuples, as TransferRequest: one is built per object per read, and a frozen dataclass costs
    ~4x as much to construct.
    """

    segment_id: int
    node: str
    tcp_endpoint: str
    shm_path: str
    offset: int
    length: int
    expiry_ms: int
    mac: bytes
    tier: int = 0

    def grant(self, op: GrantOp, key: bytes) -> Grant:
        return Grant(op, self.segment_id, self.offset, self.length, self.expiry_ms, key, self.mac)


def replica_of(d: pb.ReplicaDescriptor) -> Replica:
    """The master's descriptor (its grant included) as a Replica."""
    return Replica(d.segment_id, d.node, d.tcp_endpoint, d.shm_path, d.offset, d.length, d.expiry_ms, d.mac, d.tier)


class TransferRequest(NamedTuple):
    """One object transfer. ``buffer`` is the source (WRITE) or destination (READ); its length is the
    object's length.

    WRITE: ``checksum`` is recorded in the store's inventory; a :class:`LazyChecksum` is computed by the
    transport when it sends the bytes. READ with ``verify``: ``checksum`` is the object's, and the
    transport compares the landed bytes with it (CHECKSUM_MISMATCH if they differ), as soon as they land.
    READ with ``revalidate``: the replica's grant may have ended; the store serves the read if it still
    holds exactly this object (decision 0014; only a transport with ``revalidates_reads`` takes these).
    """

    op: GrantOp
    key: bytes
    replica: Replica
    buffer: memoryview
    checksum: int | LazyChecksum = 0
    verify: bool = False
    revalidate: bool = False

    def write_checksum(self) -> int:
        return checksum_value(self.checksum)

    def check_landed(self) -> ErrorCode:
        """Compare the bytes read into ``buffer`` with the object's checksum."""
        data = self.buffer[: self.replica.length]
        return ErrorCode.OK if checksum(data) == checksum_value(self.checksum) else ErrorCode.CHECKSUM_MISMATCH


class TransferBatch(ABC):
    """A submitted batch; ``wait`` returns one code per request, in submission order."""

    @abstractmethod
    def wait(self, deadline: Deadline) -> list[ErrorCode]: ...


class CompletedBatch(TransferBatch):
    """A batch that finished inside ``submit`` (synchronous transports)."""

    def __init__(self, codes: list[ErrorCode]) -> None:
        self._codes = codes

    def wait(self, deadline: Deadline) -> list[ErrorCode]:
        return self._codes


class Transport(ABC):
    """Moves bytes between local memory and store segments."""

    name: str = "abstract"
    verifies_reads: bool = False
    """Whether READs with ``verify`` are checked by the transport itself (else TransportSet checks them)."""
    revalidates_reads: bool = False
    """Whether a READ with ``revalidate`` (an ended grant) goes to the store, which checks that it still
    holds the object. Transports that touch the segment without the store (shm, RDMA) cannot."""

    def register_memory(self, buffer: memoryview) -> None:  # noqa: B027 - optional hook, no-op by default
        """Make ``buffer`` usable as a zero-copy source/destination (RDMA registers an MR)."""

    def unregister_memory(self, buffer: memoryview) -> None:  # noqa: B027 - optional hook
        """Undo :meth:`register_memory`."""

    def can_reach(self, replica: Replica) -> bool:
        """Whether this transport can serve this replica (shm: only same-node segments)."""
        return True

    @abstractmethod
    def submit(self, requests: Sequence[TransferRequest], deadline: Deadline) -> TransferBatch:
        """Start the transfers; never raises for a per-request failure."""

    def transfer(self, requests: Sequence[TransferRequest], deadline: Deadline) -> list[ErrorCode]:
        return self.submit(requests, deadline).wait(deadline)

    @abstractmethod
    def close(self) -> None:
        """Release connections and registrations; safe to call twice."""
