"""Opt-in: GPU memory over a real NIC (decision 0023). Runs only with both ``KVPOOL_TEST_RDMA_DEVICE`` (a device,
as for test_rdma_real.py) and ``KVPOOL_TEST_CUDA=1``, on a host with a CUDA GPU; skipped otherwise.

It reports which path this host gives CUDA buffers (dma-buf, nvidia-peermem or the pinned host staging
buffer) and moves CUDA tensors through the staging path over a real loopback QP, byte for byte. The command
is in docs/rdma.md; the team's machines have neither a NIC nor a GPU, so it has not run there.
"""

from __future__ import annotations

import pytest

from kvpool.common.clock import Deadline
from kvpool.common.envs import KVPOOL_TEST_CUDA, KVPOOL_TEST_RDMA_DEVICE
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import GrantOp
from tests.integration.test_rdma_real import _request, _Segment, loopback

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
