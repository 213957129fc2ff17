"""GPU memory over RDMA without a GPU (decision 0023): the path a buffer takes, the one log line of the
staging fallback, and the staging buffer itself with CPU tensors and a FAKE stream, through the fake NIC."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch

from kvpool.common import log as log_module
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import GrantOp
from kvpool.transfer.rdma_gpu import GpuPath, GpuSupport, StagingBuffer, choose_gpu_path, probe_gpu_support
from tests.unit.transfer.test_rdma_fake import _teardown, make_rig


class FakeCudaTensor:
    """Stands in for a CUDA tensor where there is no GPU: what the decision looks at."""

    is_cuda = True

    def data_ptr(self) -> int:
        return 0x7F00_0000_0000


class FakeStream:
    """A FAKE CUDA stream: counts synchronizations (copies on CPU tensors are synchronous anyway)."""

    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def _on(stream: FakeStream) -> AbstractContextManager[None]:
    return nullcontext()


@pytest.mark.parametrize(
    ("support", "path"),
    [
        (GpuSupport(dmabuf=True, peermem=True), GpuPath.DMABUF),
        (GpuSupport(dmabuf=False, peermem=True), GpuPath.PEERMEM),
        (GpuSupport(dmabuf=False, peermem=False, why_not="nothing"), GpuPath.STAGING),
    ],
)
def test_a_cuda_buffer_takes_the_best_path_the_host_offers(
    support: GpuSupport, path: GpuPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(log_module, "_once_seen", set())
    assert choose_gpu_path(FakeCudaTensor(), support) is path
    assert choose_gpu_path(torch.zeros(4), support) is GpuPath.HOST  # a CPU tensor is host memory
    assert choose_gpu_path(bytearray(4), support) is GpuPath.HOST


def test_the_staging_fallback_is_said_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(log_module, "_once_seen", set())
    support = probe_gpu_support(lambda: False, lambda: True, lambda path: False)
    assert support == GpuSupport(
        False, False, "no dma-buf registration (pyverbs lacks DmaBufMR); nvidia_peermem is not loaded"
    )
    with caplog.at_level(logging.WARNING, logger="kvpool.transfer.rdma_gpu"):
        for _ in range(3):
            assert choose_gpu_path(FakeCudaTensor(), support) is GpuPath.STAGING
    lines = [r.getMessage() for r in caplog.records if "staging" in r.getMessage()]
    assert lines == [
        "RDMA cannot reach GPU memory here (no dma-buf registration (pyverbs lacks DmaBufMR); nvidia_peermem is "
        "not loaded): CUDA buffers go through a pinned host staging buffer"
    ]


def test_probing_finds_each_way_in() -> None:
    assert probe_gpu_support(lambda: True, lambda: True, lambda path: False).dmabuf
    peermem = probe_gpu_support(lambda: True, lambda: False, lambda path: path.endswith("nvidia_peermem"))
    assert (peermem.dmabuf, peermem.peermem, peermem.why_not) == (False, True, "")


def test_staged_tensors_round_trip_over_the_fake_nic() -> None:
    stream = FakeStream()
    staging = StagingBuffer(
        1 << 20, allocate=lambda n: torch.empty(n, dtype=torch.uint8), stream=stream, use_stream=_on
    )
    sources = [torch.randn(1000, dtype=torch.float16), torch.arange(3000, dtype=torch.int32)]
    out = staging.stage_out(sources)
    assert [len(v) for v in out] == [2000, 12000]
    assert bytes(out[1]) == sources[1].numpy().tobytes()
    rig = make_rig()
    try:
        writes = [rig.request(GrantOp.WRITE, b"k%d" % i, i * 65536, v) for i, v in enumerate(out)]
        assert rig.transport.transfer(writes, Deadline(10)) == [ErrorCode.OK] * 2
        targets = [torch.zeros(1000, dtype=torch.float16), torch.zeros(3000, dtype=torch.int32)]
        back = StagingBuffer(
            1 << 20, allocate=lambda n: torch.empty(n, dtype=torch.uint8), stream=stream, use_stream=_on
        )
        slots = back.slots([2000, 12000])
        reads = [rig.request(GrantOp.READ, b"k%d" % i, i * 65536, bytearray(len(s))) for i, s in enumerate(slots)]
        reads = [r._replace(buffer=s) for r, s in zip(reads, slots, strict=True)]
        assert rig.transport.transfer(reads, Deadline(10)) == [ErrorCode.OK] * 2
        back.stage_in(targets)
    finally:
        _teardown(rig)
    assert all(torch.equal(a, b) for a, b in zip(sources, targets, strict=True))
    assert stream.synchronized == 2  # one wait per direction, not per tensor


def test_staging_refuses_what_does_not_fit_or_is_not_contiguous() -> None:
    staging = StagingBuffer(
        64, allocate=lambda n: torch.empty(n, dtype=torch.uint8), stream=FakeStream(), use_stream=_on
    )
    with pytest.raises(ValueError, match="do not fit"):
        staging.stage_out([torch.zeros(65, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="contiguous"):
        staging.stage_in([torch.zeros(4, 4, dtype=torch.uint8).t()])
