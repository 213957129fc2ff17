"""Opt-in: GPU memory over a real NIC (decision 0023). Runs only with both ``KVPOOL_TEST_RDMA_DEVICE`` (a device,
as for test_rdma_real.py) and ``KVPOOL_TEST_CUDA=1``, on a host with a CUDA GPU; skipped otherwise.

It reports which path this host gives CUDA buffers (dma-buf, nvidia-peermem or the pinned host staging
buffer), moves CUDA tensors through the staging buffer over a real loopback QP, and moves CUDA tensors with
``PoolClient.batch_put_from`` / ``batch_get_into`` through a real store process serving RDMA on the device,
byte for byte, checking with the client's counters that the bytes took the path the host offers. The command is
in docs/rdma.md; the team's machines have neither a NIC nor a GPU, so it has not run there.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpool.common.clock import Deadline
from kvpool.common.envs import KVPOOL_TEST_CUDA, KVPOOL_TEST_RDMA_DEVICE
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import GrantOp
from tests.integration.test_rdma_real import _device, _request, _Segment, loopback

__all__ = ["loopback"]  # the fixture, shared with test_rdma_real.py

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not (KVPOOL_TEST_RDMA_DEVICE.is_set() and KVPOOL_TEST_CUDA.get()),
        reason="opt-in: set KVPOOL_TEST_RDMA_DEVICE=<device> and KVPOOL_TEST_CUDA=1 on a host with a NIC and a GPU",
    ),
]


def test_cuda_tensors_round_trip_through_the_staging_path(loopback: tuple[object, _Segment, bytes, str]) -> None:
    import torch

    from kvpool.transfer.rdma import RdmaTransport
    from kvpool.transfer.rdma_gpu import GpuPath, StagingBuffer, choose_gpu_path, probe_gpu_support

    assert torch.cuda.is_available(), "KVPOOL_TEST_CUDA=1 but torch sees no CUDA device"
    transport, _, secret, endpoint = loopback
    assert isinstance(transport, RdmaTransport)
    sources = [torch.randn(32768, dtype=torch.float16, device="cuda") for _ in range(4)]  # 64 KiB pages
    path = choose_gpu_path(sources[0], probe_gpu_support())
    print(f"\nGPU path on this host: {path.value}")
    assert path in (GpuPath.DMABUF, GpuPath.PEERMEM, GpuPath.STAGING)

    out_stage, in_stage = StagingBuffer(1 << 20), StagingBuffer(1 << 20)
    transport.register_memory(out_stage.view(1 << 20))
    transport.register_memory(in_stage.view(1 << 20))
    views = out_stage.stage_out(sources)
    writes = [
        _request(GrantOp.WRITE, b"gpu%d" % i, i * len(v), bytearray(len(v)), secret, endpoint)._replace(buffer=v)
        for i, v in enumerate(views)
    ]
    assert transport.transfer(writes, Deadline(10.0)) == [ErrorCode.OK] * len(writes)
    slots = in_stage.slots([len(v) for v in views])
    reads = [
        _request(GrantOp.READ, b"gpu%d" % i, i * len(s), bytearray(len(s)), secret, endpoint)._replace(buffer=s)
        for i, s in enumerate(slots)
    ]
    assert transport.transfer(reads, Deadline(10.0)) == [ErrorCode.OK] * len(reads)
    targets = [torch.zeros_like(t) for t in sources]
    in_stage.stage_in(targets)
    assert all(torch.equal(a, b) for a, b in zip(sources, targets, strict=True))


def test_pool_client_moves_cuda_tensors_through_a_real_store(make_cluster: Callable[..., object]) -> None:
    import torch

    from kvpool.client import ClientConfig, PoolClient
    from kvpool.transfer.factory import make_transports
    from kvpool.transfer.rdma_gpu import choose_gpu_path, probe_gpu_support
    from kvpool.transfer.registry import TransportSet

    assert torch.cuda.is_available(), "KVPOOL_TEST_CUDA=1 but torch sees no CUDA device"
    name, _, gid_index = _device()
    cluster = make_cluster(
        stores=1, store_size="64MiB", store_args=("--rdma-device", name, "--rdma-gid-index", str(gid_index))
    )
    transports = TransportSet(make_transports("gpu-node", True, rdma_device=name, gid_index=gid_index), "gpu-node")
    config = ClientConfig(master=cluster.master, timeout_s=10.0, use_shm=False)
    sizes = [65536] * 16 + [4 << 20]  # HiCache-like pages and one large object
    with PoolClient(config=config, transports=transports) as pool:
        sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for n in sizes]
        keys = [f"gpu-pool-{i}" for i in range(len(sizes))]
        assert pool.batch_put_from(keys, sources) == [0] * len(keys)
        targets = [torch.zeros_like(t) for t in sources]
        assert pool.batch_get_into(keys, targets) == sizes
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(sources, targets, strict=True))
        assert pool.batch_get(keys) == [bytes(t.cpu().numpy()) for t in sources]  # the recorded checksums hold
        metrics = pool.metrics()
    path = choose_gpu_path(sources[0], probe_gpu_support())
    print(f"\nGPU path on this host: {path.value}; client metrics: {metrics}")
    assert metrics[f"gpu_bytes_{path.value}"] == 2 * sum(sizes)
    assert metrics["bytes_rdma"] == 3 * sum(sizes)
