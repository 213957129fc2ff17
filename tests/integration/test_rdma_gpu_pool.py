"""CUDA buffers in PoolClient calls through a real store process (decision 0023), without a GPU: FAKE CUDA tensors
(host memory behind a memfd, tests/support/fake_cuda.py) over the cross-process FAKE NIC (KVPOOL_VERBS=fake).
Each path - dma-buf MR, MR over the device pointer (peermem), pinned host staging - is proved by its counters,
every value byte for byte, and what does not fit is refused without a byte written outside the buffer."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvpool.client import PoolClient
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.tools.local_cluster import LocalCluster
from kvpool.transfer.rdma_client import RdmaTransport
from kvpool.transfer.rdma_gpu import DeviceAllocation, GpuSupport
from kvpool.transfer.rdma_rails import RailsTransport
from kvpool.transfer.verbs_fake import FakeFabric
from kvpool.transfer.verbs_fake_ipc import IpcFakeFabric
from tests.support.cluster import FAST_MASTER, client
from tests.support.fake_cuda import PAGE, FakeCudaTensor, FakeDeviceOps, FakeGpuDriver

pytestmark = pytest.mark.integration

SIZES = (4096, 65536, (1 << 20) + 3)
PAYLOAD = sum(SIZES)


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One small store serving RDMA through the fake NIC; this process's clients use the fake NIC too."""
    base = tmp_path_factory.mktemp("gpu-pool")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVPOOL_VERBS", "fake")
        env.setenv("KVPOOL_FAKE_VERBS_DIR", str(base / "fake-nic"))
        cluster = LocalCluster(stores=1, store_size="16MiB", base_dir=base / "cluster", master_args=FAST_MASTER)
        try:
            cluster.start()
            yield cluster.master
        finally:
            cluster.stop()


@pytest.fixture
def gpu() -> Iterator[FakeGpuDriver]:
    driver = FakeGpuDriver()
    yield driver
    driver.close()


def _pool(master: str, gpu: FakeGpuDriver, support: GpuSupport, **config: object) -> tuple[PoolClient, FakeDeviceOps]:
    pool = client(master, **config)
    ops = FakeDeviceOps()
    pool.device_buffers.use(support=support, driver=gpu, ops=ops)
    return pool, ops


def _filled(gpu: FakeGpuDriver) -> list[FakeCudaTensor]:
    tensors = [gpu.tensor(n) for n in SIZES]
    for tensor in tensors:
        tensor.fill(os.urandom(tensor.nbytes))
    return tensors


def _fabric(pool: PoolClient) -> FakeFabric:
    rdma = pool._transports.transport("rdma")
    assert isinstance(rdma, RdmaTransport)
    fabric = rdma.nic_fabric()
    assert isinstance(fabric, FakeFabric)
    return fabric


def _round_trip(pool: PoolClient, gpu: FakeGpuDriver, prefix: str) -> list[FakeCudaTensor]:
    """Put fake CUDA tensors, read them back into others; both byte for byte, and readable into host memory."""
    sources = _filled(gpu)
    keys = [f"{prefix}{i}" for i in range(len(sources))]
    assert pool.batch_put_from(keys, sources) == [0] * len(keys)
    targets = [gpu.tensor(n) for n in SIZES]
    assert pool.batch_get_into(keys, targets) == list(SIZES)
    assert [t.read() for t in targets] == [s.read() for s in sources]
    # The checksum a GPU write recorded is the bytes' own: a host read verifies against it.
    assert pool.batch_get(keys) == [s.read() for s in sources]
    return sources


def test_dmabuf_moves_nic_gpu_bytes_through_dmabuf_mrs_registered_once(master: str, gpu: FakeGpuDriver) -> None:
    pool, ops = _pool(master, gpu, GpuSupport(dmabuf=True, peermem=True))
    with pool:
        fabric = _fabric(pool)
        _round_trip(pool, gpu, "dmabuf")
        metrics = pool.metrics()
        assert fabric.dmabuf_bytes == 2 * PAYLOAD  # every GPU byte went through a dma-buf MR
        assert gpu.exports == 2 * len(SIZES)  # one registration per allocation
        targets = [gpu.tensor(n) for n in SIZES[:1]]
        again = [FakeCudaTensor(gpu.allocations[0], 0, SIZES[0])]  # the first source's allocation again
        assert pool.batch_put_from(["dmabuf-again"], again) == [0]
        assert pool.batch_get_into(["dmabuf-again"], targets) == [SIZES[0]]
        assert gpu.exports == 2 * len(SIZES) + 1  # only the new target's allocation was exported
    assert metrics["gpu_bytes_dmabuf"] == 2 * PAYLOAD
    assert metrics["gpu_bytes_peermem"] == metrics["gpu_bytes_staging"] == 0
    assert metrics["bytes_rdma"] == 3 * PAYLOAD  # the host read too
    assert metrics["bytes_tcp"] == 0
    assert ops.copies_to_host == ops.copies_from_host == 0  # no host bounce


def test_peermem_moves_nic_gpu_bytes_through_mrs_over_the_device_pointers(master: str, gpu: FakeGpuDriver) -> None:
    pool, ops = _pool(master, gpu, GpuSupport(dmabuf=False, peermem=True))
    with pool:
        fabric = _fabric(pool)
        posted_before = len(fabric.posted)
        _round_trip(pool, gpu, "peermem")
        metrics = pool.metrics()
        gpu_wrs = [
            wr
            for wr in list(fabric.posted)[posted_before:]
            if any(a.base <= wr.local_addr < a.base + a.size for a in gpu.allocations)
        ]
    assert sum(wr.length for wr in gpu_wrs) == 2 * PAYLOAD  # SGEs on the device pointers themselves
    assert fabric.dmabuf_bytes == 0
    assert gpu.exports == 0
    assert metrics["gpu_bytes_peermem"] == 2 * PAYLOAD
    assert metrics["gpu_bytes_dmabuf"] == metrics["gpu_bytes_staging"] == 0
    assert ops.copies_to_host == ops.copies_from_host == 0


def test_without_gpu_support_rdma_stages_through_host_memory(master: str, gpu: FakeGpuDriver) -> None:
    pool, ops = _pool(master, gpu, GpuSupport(dmabuf=False, peermem=False, why_not="a fake host"))
    with pool:
        fabric = _fabric(pool)
        _round_trip(pool, gpu, "staged")
        metrics = pool.metrics()
    assert fabric.dmabuf_bytes == 0
    assert gpu.exports == 0
    assert metrics["gpu_bytes_staging"] == 2 * PAYLOAD
    assert metrics["gpu_bytes_dmabuf"] == metrics["gpu_bytes_peermem"] == 0
    assert metrics["bytes_rdma"] == 3 * PAYLOAD
    assert (ops.copies_to_host, ops.copies_from_host) == (len(SIZES), len(SIZES))


def test_over_tcp_cuda_buffers_are_staged_through_host_memory(master: str, gpu: FakeGpuDriver) -> None:
    pool, ops = _pool(master, gpu, GpuSupport(dmabuf=True, peermem=True), use_rdma=False)
    with pool:
        assert pool._transports.transport("rdma") is None
        _round_trip(pool, gpu, "tcp")
        metrics = pool.metrics()
    assert metrics["gpu_bytes_staging"] == 2 * PAYLOAD
    assert metrics["bytes_tcp"] == 3 * PAYLOAD
    assert metrics["bytes_rdma"] == 0
    assert (ops.copies_to_host, ops.copies_from_host) == (len(SIZES), len(SIZES))


@pytest.mark.parametrize("support", [GpuSupport(True, False), GpuSupport(False, False, "fake")], ids=str)
def test_a_cuda_buffer_too_small_strided_or_past_its_allocation_is_refused(
    master: str, gpu: FakeGpuDriver, support: GpuSupport
) -> None:
    pool, _ = _pool(master, gpu, support)
    with pool:
        key = f"small-{support.dmabuf}"  # the cluster is the module's: a key per run
        value = os.urandom(8192)
        assert pool.put(key, value) == 0
        allocation = gpu.allocate(4 * PAGE)
        guard = FakeCudaTensor(allocation, 0, 4 * PAGE)
        guard.fill(b"\xee" * (4 * PAGE))
        short = FakeCudaTensor(allocation, 0, 4096)  # the object is 8192 bytes; the allocation goes on
        host = bytearray(8192)
        codes = pool.batch_get_into([key, key], [short, host])
        assert codes == [int(ErrorCode.BUFFER_TOO_SMALL), 8192]  # a host buffer in the same call is served
        assert guard.read() == b"\xee" * (4 * PAGE)
        assert bytes(host) == value

        class Strided(FakeCudaTensor):
            @property
            def __cuda_array_interface__(self) -> dict[str, object]:
                return {"shape": (8, 256), "typestr": "|u1", "data": (self.address, False), "strides": (1, 8)}

        with pytest.raises(KvPoolError) as refused:
            pool.batch_get_into([key], [Strided(allocation, 0, 2048)])
        assert refused.value.code == ErrorCode.INVALID_ARGUMENT
        assert guard.read() == b"\xee" * (4 * PAGE)

        class PastItsAllocation(FakeCudaTensor):
            @property
            def __cuda_array_interface__(self) -> dict[str, object]:
                return {"shape": (8192,), "typestr": "|u1", "data": (self.address, False), "version": 3}

        lying = PastItsAllocation(allocation, 4 * PAGE - 4096, 4096)  # claims 8192 bytes, 4096 of them outside
        for call in (lambda: pool.batch_get_into([key], [lying]), lambda: pool.put(f"{key}-lying", lying)):
            with pytest.raises(KvPoolError) as past:
                call()
            assert past.value.code == ErrorCode.INVALID_ARGUMENT
        assert guard.read() == b"\xee" * (4 * PAGE)
        assert pool.get(f"{key}-lying") is None


def test_objects_rdma_does_not_serve_reach_the_gpu_through_a_host_bounce(master: str, gpu: FakeGpuDriver) -> None:
    """A direct path chosen, but RDMA serves none of the store's replicas (it never learns that the store has RDMA):
    the GPU values still land, over TCP through host bounce buffers, byte for byte, next to a host value."""
    pool, ops = _pool(master, gpu, GpuSupport(dmabuf=True, peermem=False))
    with pool:
        rdma = pool._transports.transport("rdma")
        assert isinstance(rdma, RdmaTransport)
        rdma.discover = False
        tensor = _filled(gpu)[0]
        host_value = os.urandom(1000)
        assert pool.batch_put_from(["bounced", "host"], [tensor, host_value]) == [0, 0]
        target = gpu.tensor(tensor.nbytes)
        assert pool.batch_get_into(["bounced"], [target]) == [tensor.nbytes]
        assert target.read() == tensor.read()
        assert pool.get("host") == host_value
        metrics = pool.metrics()
    assert metrics["gpu_bytes_staging"] == 2 * tensor.nbytes
    assert metrics["gpu_bytes_dmabuf"] == 0
    assert metrics["bytes_rdma"] == 0
    assert (ops.copies_to_host, ops.copies_from_host) == (1, 1)


class _NoDmabufDriver(FakeGpuDriver):
    """A FAKE driver that finds allocations but cannot export them (a driver without dma-buf support)."""

    def export_dmabuf(self, allocation: DeviceAllocation) -> int:
        self.exports += 1
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "cuMemGetHandleForAddressRange failed: CUresult 801")


def test_a_dmabuf_path_that_fails_is_staged_once_then_peermem_is_used(master: str) -> None:
    driver = _NoDmabufDriver()
    pool, _ = _pool(master, driver, GpuSupport(dmabuf=True, peermem=True))
    try:
        with pool:
            first = _filled(driver)[:1]
            assert pool.batch_put_from(["no-dmabuf-0"], first) == [0]  # staged: the export failed
            second = _filled(driver)[:1]
            assert pool.batch_put_from(["no-dmabuf-1"], second) == [0]  # peermem, no second export
            assert pool.batch_get(["no-dmabuf-0", "no-dmabuf-1"]) == [first[0].read(), second[0].read()]
            metrics = pool.metrics()
    finally:
        driver.close()
    assert driver.exports == 1
    assert metrics["gpu_bytes_staging"] == SIZES[0]
    assert metrics["gpu_bytes_peermem"] == SIZES[0]


def test_register_buffer_registers_a_cuda_buffers_allocation_up_front(master: str, gpu: FakeGpuDriver) -> None:
    pool, _ = _pool(master, gpu, GpuSupport(dmabuf=True, peermem=False))
    with pool:
        tensor = _filled(gpu)[0]
        assert pool.register_buffer(tensor) == 0
        assert gpu.exports == 1
        assert pool.put("registered", tensor) == 0
        assert pool.unregister_buffer(tensor) == 0
        assert gpu.exports == 1  # the registration was reused
        assert pool.get("registered") == tensor.read()
        assert pool.metrics()["gpu_bytes_dmabuf"] == SIZES[0]


def test_two_nics_each_register_the_gpu_memory_and_stripe_a_large_object(
    master: str, gpu: FakeGpuDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPOOL_FAKE_VERBS_DEVICES", "fake_gpu_rail_0,fake_gpu_rail_1")
    pool, _ = _pool(master, gpu, GpuSupport(dmabuf=True, peermem=False))
    with pool:
        rails = pool._transports.transport("rdma")
        assert isinstance(rails, RailsTransport)
        before = {d: IpcFakeFabric.bytes_by_device.get(d, 0) for d in ("fake_gpu_rail_0", "fake_gpu_rail_1")}
        source = gpu.tensor(4 << 20)
        source.fill(os.urandom(4 << 20))
        target = gpu.tensor(4 << 20)
        assert pool.put("striped", source) == 0
        assert pool.get_into("striped", target) == 4 << 20
        assert target.read() == source.read()
        fabrics = {id(f): f for f in (rail.nic_fabric() for rail in rails.rails)}
        dmabuf_bytes = sum(f.dmabuf_bytes for f in fabrics.values() if isinstance(f, FakeFabric))
    grown = {d: IpcFakeFabric.bytes_by_device.get(d, 0) - n for d, n in before.items()}
    assert grown == {"fake_gpu_rail_0": 4 << 20, "fake_gpu_rail_1": 4 << 20}  # half of each transfer per rail
    assert dmabuf_bytes == 8 << 20
    assert gpu.exports == 2 * 2  # each allocation, once per rail
