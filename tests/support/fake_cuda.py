"""A FAKE GPU for tests on machines without one (decision 0023): fake CUDA tensors, a fake driver that exports
them as fake dma-bufs, and fake device copies.

The fake "device memory" of an allocation is a memfd mapped into this process, so

* a :class:`FakeCudaTensor` exposes ``__cuda_array_interface__`` over that mapping (what the client reads);
* :class:`FakeGpuDriver` answers which allocation holds an address and exports an allocation as a dma-buf:
  a duplicate of the memfd, offset 0 at the allocation's base (what ``cuMemGetHandleForAddressRange`` gives);
  the fake NIC maps that fd for a dma-buf MR, so its bytes land in the tensor through a second mapping;
* :class:`FakeDeviceOps` copies with ``memmove`` (the "device" is host memory) and counts what it did.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass, field
from typing import Any

from kvpool.common.checksum import checksum
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.transfer.rdma_gpu import DeviceAllocation
from kvpool.transfer.verbs import buffer_address

PAGE = mmap.PAGESIZE


@dataclass(eq=False)
class FakeAllocation:
    """One fake ``cudaMalloc``: a memfd mapped into this process."""

    size: int
    buffer_id: int
    fd: int = -1
    mapping: mmap.mmap | None = None
    base: int = 0

    def open(self) -> FakeAllocation:
        self.fd = os.memfd_create("kvpool-fake-gpu", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.mapping = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED)
        self.base = buffer_address(memoryview(self.mapping))
        return self

    def close(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FakeCudaTensor:
    """A FAKE CUDA tensor: ``nbytes`` bytes at ``offset`` of a fake allocation, as ``__cuda_array_interface__``
    (a 1-D uint8 array). The test reads and writes its bytes with :meth:`read` and :meth:`fill`."""

    def __init__(self, allocation: FakeAllocation, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > allocation.size:
            raise ValueError("a fake tensor must lie inside its allocation")
        self.allocation = allocation
        self.address = allocation.base + offset
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "version": 3}

    def read(self) -> bytes:
        return ctypes.string_at(self.address, self.nbytes)

    def fill(self, data: bytes) -> None:
        assert len(data) == self.nbytes
        ctypes.memmove(self.address, data, len(data))


@dataclass
class FakeGpuDriver:
    """The FAKE driver: allocations by address, dma-buf export (counted)."""

    allocations: list[FakeAllocation] = field(default_factory=list)
    exports: int = 0

    def allocate(self, nbytes: int) -> FakeAllocation:
        size = -(-nbytes // PAGE) * PAGE
        allocation = FakeAllocation(size, buffer_id=len(self.allocations) + 1).open()
        self.allocations.append(allocation)
        return allocation

    def tensor(self, nbytes: int) -> FakeCudaTensor:
        """A tensor in an allocation of its own."""
        return FakeCudaTensor(self.allocate(nbytes), 0, nbytes)

    def allocation(self, address: int) -> DeviceAllocation:
        for a in self.allocations:
            if a.base <= address < a.base + a.size:
                return DeviceAllocation(a.base, a.size, a.buffer_id)
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"{address:#x} is no fake device memory")

    def export_dmabuf(self, allocation: DeviceAllocation) -> int:
        for a in self.allocations:
            if a.base == allocation.base:
                self.exports += 1
                return os.dup(a.fd)
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "no such fake allocation")

    def close(self) -> None:
        for a in self.allocations:
            a.close()


@dataclass
class FakeDeviceOps:
    """FAKE device copies: ``memmove`` on the host-backed fake device memory, counted."""

    copies_to_host: int = 0
    copies_from_host: int = 0
    synchronized: int = 0
    hashed_bytes: int = 0

    def host_buffer(self, nbytes: int) -> memoryview:
        return memoryview(bytearray(nbytes))

    def to_host(self, address: int, host: memoryview) -> None:
        ctypes.memmove(buffer_address(host), address, len(host))
        self.copies_to_host += 1

    def from_host(self, host: memoryview, address: int) -> None:
        ctypes.memmove(address, bytes(host), len(host))
        self.copies_from_host += 1

    def synchronize(self) -> None:
        self.synchronized += 1

    def checksum(self, address: int, nbytes: int) -> int:
        self.hashed_bytes += nbytes
        return checksum(ctypes.string_at(address, nbytes))
