"""GPU memory over RDMA (docs/rdma.md, "GPU memory"; decision 0023): which path a CUDA buffer takes, and the
pinned host staging buffer used where the NIC cannot reach GPU memory.

Paths, best first:

- ``DMABUF``: the CUDA allocation is exported as a dma-buf (``cuMemGetHandleForAddressRange``) and registered
  with ``ibv_reg_dmabuf_mr`` (pyverbs ``DmaBufMR``): the NIC reads and writes GPU memory, no host bounce.
- ``PEERMEM``: the ``nvidia_peermem`` kernel module is loaded, so a plain ``ibv_reg_mr`` over the device
  pointer pins GPU pages for the NIC (the older GPUDirect RDMA route).
- ``STAGING``: neither: the bytes go through a pinned host buffer registered as an ordinary MR, with the
  GPU<->host copies asynchronous on a CUDA stream (:class:`StagingBuffer`). Said once in the log.

The decision is a pure function of what the host offers (:class:`GpuSupport`), so it is tested with CPU tensors
and fakes; the GPU itself is exercised only by the opt-in test (``KVPOOL_TEST_CUDA=1``).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger, log_once

logger = get_logger(__name__)

STAGING_LOG_KEY = "kvpool.rdma.gpu.staging"
_PEERMEM_MODULES = ("/sys/module/nvidia_peermem", "/sys/module/nv_peer_mem")


class GpuPath(enum.Enum):
    HOST = "host"
    """Not GPU memory: registered as any host buffer."""
    DMABUF = "dmabuf"
    PEERMEM = "peermem"
    STAGING = "staging"


@dataclass(frozen=True)
class GpuSupport:
    """What this host offers for GPU memory over RDMA."""

    dmabuf: bool
    """pyverbs has ``DmaBufMR`` and the CUDA driver exports dma-bufs (``cuMemGetHandleForAddressRange``)."""
    peermem: bool
    """The ``nvidia_peermem`` (or older ``nv_peer_mem``) kernel module is loaded."""
    why_not: str = ""
    """Why neither works (for the one log line), empty when one does."""


def is_cuda_buffer(buffer: object) -> bool:
    """A torch CUDA tensor (``is_cuda`` true and a ``data_ptr``), or anything exposing
    ``__cuda_array_interface__`` (CuPy, Numba, ...)."""
    is_cuda = getattr(buffer, "is_cuda", None)
    if is_cuda is not None:  # torch says itself (asking a CPU tensor for the interface raises, slowly)
        return is_cuda is True and callable(getattr(buffer, "data_ptr", None))
    return hasattr(buffer, "__cuda_array_interface__")


@dataclass(frozen=True)
class DeviceAllocation:
    """The driver's allocation holding a device pointer, page-aligned: what one registration covers."""

    base: int
    size: int
    buffer_id: int
    """The driver's id of the allocation (``CU_POINTER_ATTRIBUTE_BUFFER_ID``): never reused, so a cached
    registration of a freed and re-made allocation at the same address is recognised as stale."""


class GpuDriver(Protocol):
    """What the dma-buf and peermem paths ask the GPU driver (:class:`CudaDriver`; tests pass a FAKE)."""

    def allocation(self, address: int) -> DeviceAllocation:
        """The allocation holding ``address``; raises KvPoolError(INVALID_ARGUMENT) for a non-device one."""
        ...

    def export_dmabuf(self, allocation: DeviceAllocation) -> int:
        """A new dma-buf fd over the allocation, offset 0 at ``allocation.base`` (the caller closes it)."""
        ...


_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
_PAGE = os.sysconf("SC_PAGE_SIZE")


class CudaDriver:
    """:class:`GpuDriver` over libcuda (ctypes on ``libcuda.so.1``; the CUDA context is torch's)."""

    def __init__(self) -> None:
        try:
            self._cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise KvPoolError(ErrorCode.NOT_SUPPORTED, f"no CUDA driver (libcuda.so.1): {exc}") from exc

    def _call(self, what: str, result: int) -> None:
        if result != 0:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"{what} failed: CUresult {result}")

    def allocation(self, address: int) -> DeviceAllocation:
        base, size, buffer_id = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_uint64()
        self._call(
            "cuMemGetAddressRange",
            self._cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)),
        )
        self._call(
            "cuPointerGetAttribute(BUFFER_ID)",
            self._cuda.cuPointerGetAttribute(
                ctypes.byref(buffer_id), _CU_POINTER_ATTRIBUTE_BUFFER_ID, ctypes.c_uint64(address)
            ),
        )
        start = base.value - base.value % _PAGE  # dma-buf export wants page-aligned ranges
        end = -(-(base.value + size.value) // _PAGE) * _PAGE
        return DeviceAllocation(start, end - start, buffer_id.value)

    def export_dmabuf(self, allocation: DeviceAllocation) -> int:
        fd = ctypes.c_int(-1)
        self._call(
            "cuMemGetHandleForAddressRange(DMA_BUF_FD)",
            self._cuda.cuMemGetHandleForAddressRange(
                ctypes.byref(fd),
                ctypes.c_uint64(allocation.base),
                ctypes.c_size_t(allocation.size),
                _CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                ctypes.c_ulonglong(0),
            ),
        )
        return fd.value


def device_pointer(buffer: Any) -> tuple[int, int]:
    """(device address, bytes) of a C-contiguous CUDA buffer; KvPoolError(INVALID_ARGUMENT) for any other."""
    if getattr(buffer, "is_cuda", False) is True and callable(getattr(buffer, "data_ptr", None)):
        # torch first: its __cuda_array_interface__ raises for a tensor that requires grad
        if not buffer.is_contiguous():
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "a CUDA buffer must be contiguous")
        return int(buffer.data_ptr()), int(buffer.numel()) * int(buffer.element_size())
    interface = buffer.__cuda_array_interface__
    shape = tuple(int(n) for n in interface["shape"])
    itemsize = int(interface["typestr"][2:])
    strides = interface.get("strides")
    expected, stride = [], itemsize
    for n in reversed(shape):
        expected.append(stride)
        stride *= n
    if strides is not None and tuple(strides) != tuple(reversed(expected)) and stride:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "a CUDA buffer must be C-contiguous")
    return int(interface["data"][0]), stride


def probe_gpu_support(
    pyverbs_dmabuf: Callable[[], bool] | None = None,
    cuda_dmabuf: Callable[[], bool] | None = None,
    module_loaded: Callable[[str], bool] = os.path.exists,
) -> GpuSupport:
    """Ask the host (each probe is injectable for tests)."""
    has_pyverbs = (pyverbs_dmabuf or _pyverbs_has_dmabuf)()
    has_cuda = (cuda_dmabuf or _cuda_exports_dmabuf)()
    peermem = any(module_loaded(path) for path in _PEERMEM_MODULES)
    reasons = []
    if not (has_pyverbs and has_cuda):
        reasons.append(
            "no dma-buf registration ("
            + ", ".join(
                r
                for r, missing in (
                    ("pyverbs lacks DmaBufMR", not has_pyverbs),
                    ("the CUDA driver exports no dma-buf", not has_cuda),
                )
                if missing
            )
            + ")"
        )
    if not peermem:
        reasons.append("nvidia_peermem is not loaded")
    dmabuf = has_pyverbs and has_cuda
    return GpuSupport(dmabuf, peermem, "" if dmabuf or peermem else "; ".join(reasons))


def choose_gpu_path(buffer: object, support: GpuSupport) -> GpuPath:
    """The path a buffer takes; the staging fallback is logged once per process."""
    if not is_cuda_buffer(buffer):
        return GpuPath.HOST
    if support.dmabuf:
        return GpuPath.DMABUF
    if support.peermem:
        return GpuPath.PEERMEM
    log_once(
        logger,
        logging.WARNING,
        STAGING_LOG_KEY,
        "RDMA cannot reach GPU memory here (%s): CUDA buffers go through a pinned host staging buffer",
        support.why_not or "unknown",
    )
    return GpuPath.STAGING


def _pyverbs_has_dmabuf() -> bool:
    try:
        from pyverbs.mr import DmaBufMR  # noqa: F401 - only whether it exists
    except Exception:  # ImportError, or a pyverbs that fails to load without a device
        return False
    return True


def _cuda_exports_dmabuf() -> bool:
    """Whether libcuda has ``cuMemGetHandleForAddressRange`` (CUDA 11.7+ drivers with dma-buf support)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return hasattr(libcuda, "cuMemGetHandleForAddressRange")


# ---------------------------------------------------------------------- the staging fallback
class Stream(Protocol):
    """What the staging buffer needs of a CUDA stream (``torch.cuda.Stream``)."""

    def synchronize(self) -> None: ...


class StagingBuffer:
    """A pinned host buffer between a GPU tensor and the NIC: an ordinary MR for RDMA, filled and drained by
    asynchronous copies on one stream.

    ``allocate(nbytes)`` returns the host tensor (default: ``torch.empty(n, dtype=uint8, pin_memory=True)``);
    ``stream`` and ``use_stream`` default to a new ``torch.cuda.Stream`` and ``torch.cuda.stream``. Tests pass
    CPU tensors and a named fake stream.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        allocate: Callable[[int], Any] | None = None,
        stream: Stream | None = None,
        use_stream: Callable[[Stream], AbstractContextManager[Any]] | None = None,
    ) -> None:
        if nbytes <= 0:
            raise ValueError("a staging buffer needs a positive size")
        if allocate is None or stream is None or use_stream is None:
            import torch

            allocate = allocate or _pinned
            stream = stream or torch.cuda.Stream()  # type: ignore[no-untyped-call]
            use_stream = use_stream or _on_cuda_stream
        self.host = allocate(nbytes)
        self.nbytes = nbytes
        self._stream: Stream = stream
        self._use_stream: Callable[[Stream], AbstractContextManager[Any]] = use_stream

    def view(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the host buffer as bytes (what the NIC reads or writes)."""
        if nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes do not fit a staging buffer of {self.nbytes}")
        array: Any = self.host.numpy()
        return memoryview(array).cast("B")[:nbytes]

    def stage_out(self, tensors: list[Any]) -> list[memoryview]:
        """Copy GPU tensors into the host buffer back to back (asynchronously, then wait): their host views,
        ready for RDMA WRITE."""
        views = []
        offset = 0
        with self._use_stream(self._stream):
            for tensor in tensors:
                n = _nbytes(tensor)
                self._slot(offset, n).copy_(_as_bytes(tensor), non_blocking=True)
                views.append(self.view(offset + n)[offset:])
                offset += n
        self._stream.synchronize()
        return views

    def slots(self, sizes: list[int]) -> list[memoryview]:
        """Host views, back to back, for RDMA READs of objects of ``sizes`` bytes."""
        views = []
        offset = 0
        for n in sizes:
            views.append(self.view(offset + n)[offset:])
            offset += n
        return views

    def stage_in(self, tensors: list[Any]) -> None:
        """Copy what landed in the host buffer (by :meth:`slots`) into the GPU tensors, and wait."""
        offset = 0
        with self._use_stream(self._stream):
            for tensor in tensors:
                n = _nbytes(tensor)
                _as_bytes(tensor).copy_(self._slot(offset, n), non_blocking=True)
                offset += n
        self._stream.synchronize()

    def _slot(self, offset: int, nbytes: int) -> Any:
        if offset + nbytes > self.nbytes:
            raise ValueError(f"{offset + nbytes} bytes do not fit a staging buffer of {self.nbytes}")
        return self.host[offset : offset + nbytes]


def _pinned(nbytes: int) -> Any:
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _on_cuda_stream(stream: Stream) -> AbstractContextManager[Any]:
    import torch

    return torch.cuda.stream(stream)  # type: ignore[arg-type]


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _as_bytes(tensor: Any) -> Any:
    """The tensor's own bytes (a view, so copies into it land in the tensor): contiguous tensors only."""
    import torch

    if not tensor.is_contiguous():
        raise ValueError("a staged tensor must be contiguous (its bytes are copied as one range)")
    return tensor.view(-1).view(torch.uint8)
