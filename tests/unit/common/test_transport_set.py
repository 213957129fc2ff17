"""TransportSet verifies READs itself for transports that do not (RDMA), and leaves the others alone."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.common.checksum import checksum
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import GrantOp
from kvpool.transfer.base import CompletedBatch, Replica, TransferBatch, TransferRequest, Transport
from kvpool.transfer.registry import TransportSet


class FakeMemoryTransport(Transport):
    """A fake: 'reads' copy from one in-process byte string, like a one-sided RDMA READ would."""

    name = "fake-memory"

    def __init__(self, data: bytes, verifies: bool) -> None:
        self.data = data
        self.verifies_reads = verifies

    def submit(self, requests: Sequence[TransferRequest], deadline: Deadline) -> TransferBatch:
        for req in requests:
            req.buffer[: len(self.data)] = self.data
        return CompletedBatch([ErrorCode.OK] * len(requests))

    def close(self) -> None:
        pass


def _read(expected: int, out: bytearray, verify: bool = True) -> TransferRequest:
    replica = Replica(1, "n", "127.0.0.1:1", "", 0, len(out), 0, b"")
    return TransferRequest(GrantOp.READ, b"k", replica, memoryview(out), expected, verify)


def test_reads_of_a_non_verifying_transport_are_checked_by_the_set() -> None:
    data = b"x" * 1000
    outs = [bytearray(1000) for _ in range(3)]
    requests = [_read(checksum(data), outs[0]), _read(checksum(data) + 1, outs[1]), _read(0, outs[2], verify=False)]
    codes = TransportSet([FakeMemoryTransport(data, verifies=False)]).transfer(requests, Deadline(1))
    assert codes == [ErrorCode.OK, ErrorCode.CHECKSUM_MISMATCH, ErrorCode.OK]


def test_a_verifying_transport_is_trusted() -> None:
    data = b"y" * 10
    out = bytearray(10)
    codes = TransportSet([FakeMemoryTransport(data, verifies=True)]).transfer([_read(1, out)], Deadline(1))
    assert codes == [ErrorCode.OK]  # the fake claims to verify and does not: the set does not hash again


class _NodeTransport(FakeMemoryTransport):
    """A fake that reaches only the replicas of one node (as shm does), revalidating or not."""

    def __init__(self, node: str | None, revalidates: bool) -> None:
        super().__init__(b"", verifies=True)
        self.node = node
        self.revalidates_reads = revalidates

    def can_reach(self, replica: Replica) -> bool:
        return self.node is None or replica.node == self.node


def test_only_dram_replicas_of_a_revalidating_transport_take_revalidated_reads() -> None:
    """A transport that touches the segment itself (shm, RDMA) cannot ask the store whether the object
    is still there (decision 0014): its replicas, and SSD-tier ones, are left out."""
    local = Replica(1, "here", "127.0.0.1:1", "/dev/shm/x", 0, 10, 0, b"")
    remote = Replica(2, "there", "127.0.0.1:2", "", 0, 10, 0, b"")
    on_ssd = Replica(3, "there", "127.0.0.1:2", "", 0, 10, 0, b"", tier=1)
    transports = TransportSet(
        [_NodeTransport("here", revalidates=False), _NodeTransport(None, revalidates=True)], "here"
    )
    assert transports.revalidating([on_ssd, local, remote]) == [remote]
    assert transports.revalidating([local]) == []
