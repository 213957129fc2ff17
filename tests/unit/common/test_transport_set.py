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
