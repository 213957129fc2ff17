"""GPU memory registered for RDMA without a GPU (decision 0023): dma-buf MRs addressed by IOVA in the fake NIC,
the client's cache of GPU registrations, the SGE addresses it plans, and the bounce of what RDMA cannot serve.
The GPU is a FAKE (tests/support/fake_cuda.py): host memory behind a memfd, exported as a fake dma-buf."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator

import pytest
import torch

from kvpool.client.device_buffers import DeviceTransportSet, find_cuda
from kvpool.common.checksum import LazyChecksum, checksum
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import GrantOp
from kvpool.transfer.rdma_gpu import CudaDriver, GpuPath, device_pointer
from kvpool.transfer.rdma_memory import _LocalMemory, plan_pieces
from kvpool.transfer.rdma_wire import RemoteRegion
from kvpool.transfer.registry import TransportSet
from kvpool.transfer.verbs import Access, Opcode, QpInfo, VerbsError, WcStatus, WorkRequest, buffer_address
from kvpool.transfer.verbs_fake import FakeContext, FakeFabric, FakeQP, FakeVerbs
from tests.support.fake_cuda import PAGE, FakeCudaTensor, FakeDeviceOps, FakeGpuDriver
from tests.unit.transfer.test_rdma_fake import Rig, _teardown, make_rig


@pytest.fixture
def gpu() -> Iterator[FakeGpuDriver]:
    driver = FakeGpuDriver()
    yield driver
    driver.close()


def _pair() -> tuple[FakeContext, FakeQP, FakeContext]:
    """Two fake nodes with a connected RC QP: (local context, its QP, remote context)."""
    fabric = FakeFabric()
    here = FakeVerbs(fabric, devices=("here",)).open("here")
    there = FakeVerbs(fabric, devices=("there",)).open("there")
    qp_here = here.create_qp(here.create_cq(8), 4)
    qp_there = there.create_qp(there.create_cq(8), 4)
    qp_here.to_init(Access.LOCAL_WRITE)
    qp_there.to_init(Access.REMOTE_READ | Access.REMOTE_WRITE)
    port_here, port_there = here.port_info(), there.port_info()
    qp_here.to_rtr(QpInfo(qp_there.qp_num, port_there.lid, port_there.gid, 7, port_there.mtu), port_there.mtu)
    qp_there.to_rtr(QpInfo(qp_here.qp_num, port_here.lid, port_here.gid, 9, port_here.mtu), port_here.mtu)
    qp_here.to_rts(9)
    qp_there.to_rts(7)
    return here, qp_here, there


def test_a_dmabuf_mr_is_addressed_by_iova_and_its_bytes_land_in_the_exported_memory(gpu: FakeGpuDriver) -> None:
    here, qp, there = _pair()
    tensor = gpu.tensor(2 * PAGE)
    remote = bytearray(os.urandom(PAGE))
    remote_mr = there.reg_mr(buffer_address(memoryview(remote)), PAGE, Access.REMOTE_READ | Access.REMOTE_WRITE)
    allocation = gpu.allocation(tensor.address)
    fd = gpu.export_dmabuf(allocation)
    try:
        mr = here.reg_dmabuf_mr(fd, PAGE, PAGE, PAGE, Access.LOCAL_WRITE)  # the allocation's second page
    finally:
        os.close(fd)  # the MR keeps the dma-buf mapped
    assert (mr.addr, mr.length) == (PAGE, PAGE)
    qp.post_send(WorkRequest(1, Opcode.RDMA_READ, PAGE + 16, 100, mr.lkey, remote_mr.addr, remote_mr.rkey))
    assert [c.status for c in qp.cq.poll(4)] == [WcStatus.SUCCESS]
    assert tensor.read()[PAGE + 16 : PAGE + 116] == bytes(remote[:100])  # IOVA PAGE+16 is byte PAGE+16
    assert tensor.read()[:PAGE] == bytes(PAGE)  # the first page, outside the MR, untouched
    assert here.fabric.dmabuf_bytes == 100
    # An SGE past the MR's IOVA range is refused as a NIC refuses it, and writes nothing.
    before = tensor.read()
    qp.post_send(WorkRequest(2, Opcode.RDMA_READ, 2 * PAGE - 50, 100, mr.lkey, remote_mr.addr, remote_mr.rkey))
    assert [c.status for c in qp.cq.poll(4)] == [WcStatus.LOC_PROT_ERR]
    assert tensor.read() == before
    assert here.fabric.dmabuf_bytes == 100
    mr.close()


def test_dmabuf_registration_refuses_what_the_dmabuf_does_not_hold(gpu: FakeGpuDriver) -> None:
    here, _, _ = _pair()
    allocation = gpu.allocation(gpu.tensor(PAGE).address)
    fd = gpu.export_dmabuf(allocation)
    try:
        for offset, length in ((0, PAGE + 1), (PAGE, 1), (-1, 10), (0, 0)):
            with pytest.raises(VerbsError) as refused:
                here.reg_dmabuf_mr(fd, offset, length, 0, Access.LOCAL_WRITE)
            assert refused.value.errno == errno.EINVAL
        with pytest.raises(VerbsError) as remote:
            here.reg_dmabuf_mr(fd, 0, PAGE, 0, Access.REMOTE_READ)
        assert remote.value.errno == errno.EOPNOTSUPP
    finally:
        os.close(fd)
    with pytest.raises(VerbsError) as closed:
        here.reg_dmabuf_mr(fd, 0, PAGE, 0, Access.LOCAL_WRITE)
    assert closed.value.errno == errno.EBADF


def test_gpu_registrations_are_cached_per_allocation_and_renewed_when_it_is_another(gpu: FakeGpuDriver) -> None:
    ctx = FakeVerbs(devices=("d",), max_mr_bytes=2 * PAGE).open("d")
    memory = _LocalMemory(ctx, 2 * PAGE)
    tensor = gpu.tensor(3 * PAGE)
    a = gpu.allocation(tensor.address)
    exports = 0

    def export() -> int:
        nonlocal exports
        exports += 1
        return gpu.export_dmabuf(a)

    reg = memory.register_device(a.base, a.size, a.buffer_id, export)
    assert memory.register_device(a.base, a.size, a.buffer_id, export) is reg
    assert (exports, ctx.mr_count) == (1, 2)  # chunks of at most max_mr_bytes, one dma-buf
    assert reg.spans() == [
        (a.base, 2 * PAGE, reg.mrs[0].lkey, 0),
        (a.base + 2 * PAGE, PAGE, reg.mrs[1].lkey, 2 * PAGE),
    ]
    assert memory.find(tensor.address + PAGE, PAGE) is reg
    # The planned SGEs name IOVAs, cut at the MR boundary.
    regions = [RemoteRegion(1, 0, 1 << 20, 0x9000_0000, 0x77)]
    pieces = plan_pieces(a.base + PAGE, reg.spans(), 0, regions, 2 * PAGE, 1 << 20)
    assert [(p.local_addr, p.length, p.lkey) for p in pieces] == [
        (PAGE, PAGE, reg.mrs[0].lkey),
        (2 * PAGE, PAGE, reg.mrs[1].lkey),
    ]
    # The same range under another allocation id: a freed and re-made allocation, registered again.
    renewed = memory.register_device(a.base, a.size, a.buffer_id + 100, export)
    assert renewed is not reg
    assert reg.mrs == []
    assert exports == 2
    assert ctx.mr_count == 2
    memory.close()
    assert ctx.mr_count == 0


def test_peermem_registers_the_device_pointer_itself(gpu: FakeGpuDriver) -> None:
    ctx = FakeVerbs(devices=("d",)).open("d")
    memory = _LocalMemory(ctx, 1 << 30)
    a = gpu.allocation(gpu.tensor(PAGE).address)
    reg = memory.register_device(a.base, a.size, a.buffer_id, None)
    assert reg.spans() == [(a.base, PAGE, reg.mrs[0].lkey)]  # SGEs name virtual addresses, as for host memory
    memory.close()


def test_a_failed_gpu_registration_is_transfer_failed(gpu: FakeGpuDriver) -> None:
    verbs = FakeVerbs(devices=("d",))
    memory = _LocalMemory(verbs.open("d"), 1 << 30)
    a = gpu.allocation(gpu.tensor(PAGE).address)
    verbs.fabric.faults.reg_mr_failures = 1
    with pytest.raises(KvPoolError) as failed:
        memory.register_device(a.base, a.size, a.buffer_id, lambda: gpu.export_dmabuf(a))
    assert failed.value.code == ErrorCode.TRANSFER_FAILED


def test_cuda_buffers_are_found_and_must_be_contiguous(gpu: FakeGpuDriver) -> None:
    tensor = gpu.tensor(4096)
    host = [b"x", bytearray(3), memoryview(b"y"), torch.zeros(4)]
    assert find_cuda(host) is None
    assert find_cuda([*host, tensor]) == {4: (tensor.address, 4096)}

    class Strided(FakeCudaTensor):
        @property
        def __cuda_array_interface__(self) -> dict[str, object]:
            return {"shape": (16, 16), "typestr": "<f4", "data": (self.address, False), "strides": (4, 64)}

    strided = Strided(tensor.allocation, 0, 1024)
    with pytest.raises(KvPoolError) as refused:
        device_pointer(strided)
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT

    class Rows(FakeCudaTensor):
        @property
        def __cuda_array_interface__(self) -> dict[str, object]:
            return {"shape": (16, 16), "typestr": "<f4", "data": (self.address, False), "strides": (64, 4)}

    assert device_pointer(Rows(tensor.allocation, 0, 1024)) == (tensor.address, 1024)


def test_without_libcuda_the_driver_is_not_supported() -> None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("this host has a CUDA driver")
    with pytest.raises(KvPoolError) as missing:
        CudaDriver()
    assert missing.value.code == ErrorCode.NOT_SUPPORTED


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = make_rig()
    yield r
    _teardown(r)


def test_what_rdma_cannot_serve_is_bounced_through_host_memory(rig: Rig, gpu: FakeGpuDriver) -> None:
    """A replica without a lease (expiry 0) is never posted on RDMA: the GPU bytes take a host bounce buffer, the
    write's checksum is the bytes' own, and a read lands in the GPU buffer."""
    source, target = gpu.tensor(8192), gpu.tensor(8192)
    source.fill(os.urandom(8192))
    ops = FakeDeviceOps()
    host_set = TransportSet([rig.transport])
    devices = {source.address, target.address}
    device_set = DeviceTransportSet(host_set, rig.transport, devices, ops, GpuPath.DMABUF)
    view = memoryview((ctypes.c_char * 8192).from_address(source.address)).cast("B")
    lazy = LazyChecksum(memoryview(b""))  # never asked to hash its (wrong) bytes: settled first
    write = rig.request(GrantOp.WRITE, b"b", 0, bytes(8192), expiry_ms=0)._replace(buffer=view, checksum=lazy)
    assert device_set.transfer([write], Deadline(10)) == [ErrorCode.OK]
    assert lazy.value == checksum(source.read())
    into = memoryview((ctypes.c_char * 8192).from_address(target.address)).cast("B")
    read = rig.request(GrantOp.READ, b"b", 0, bytearray(8192), expiry_ms=0)
    read = read._replace(buffer=into, checksum=lazy.value, verify=True)
    assert device_set.transfer([read], Deadline(10)) == [ErrorCode.OK]
    assert target.read() == source.read()
    assert (ops.copies_to_host, ops.copies_from_host, device_set.bounced_bytes, device_set.direct_bytes) == (
        1,
        1,
        16384,
        0,
    )
    assert rig.fabric.dmabuf_bytes == 0
    assert host_set.bytes_by_transport()["rdma"] == 16384  # counted in the client's own figures
