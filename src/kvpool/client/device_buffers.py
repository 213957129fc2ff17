"""CUDA buffers in ``PoolClient`` calls (decision 0023; docs/rdma.md, "GPU memory").

``batch_put_from`` / ``batch_get_into`` (and ``put`` / ``get_into``, which go through them) take CUDA buffers
- a torch tensor with ``is_cuda``, or anything exposing ``__cuda_array_interface__`` - next to host buffers.
Which path a call's CUDA buffers take:

- ``DMABUF`` / ``PEERMEM`` (the client has an RDMA transport and the host lets the NIC reach GPU memory,
  :func:`~kvpool.transfer.rdma_gpu.choose_gpu_path`): each buffer's allocation is registered once on every
  RDMA rail (a dma-buf MR, or an MR over the device pointer) and the NIC moves the bytes to and from the GPU,
  with no host bounce. The call runs the client's ordinary read or write path with a transport set that lets
  no transport but RDMA touch GPU memory (:class:`DeviceTransportSet`): an object RDMA cannot serve (SSD
  tier, a grant about to end, a revalidated read, a broken QP) goes through a host bounce buffer instead.
  The CPU cannot hash GPU memory in place, so checksums are taken by reading the bytes through host memory
  (:meth:`DeviceMemoryOps.checksum`): a write's before the NIC sends it, a read's after it lands.
- ``STAGING`` (no RDMA transport: TCP or shared memory; or RDMA that cannot reach GPU memory): the call is
  staged through a pinned host buffer with asynchronous copies on the current CUDA stream, said once in
  the log. Staged calls of one client take turns on its staging buffer.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from kvpool.client.call_parts import Buffer, PutConfig, ptr_view
from kvpool.client.read_by_key import SpeculativeReads
from kvpool.common.checksum import LazyChecksum, checksum, checksum_value
from kvpool.common.clock import SYSTEM_CLOCK, Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import GrantOp
from kvpool.common.log import get_logger, log_once
from kvpool.transfer.base import TransferRequest, Transport
from kvpool.transfer.rdma_gpu import (
    CudaDriver,
    DeviceAllocation,
    GpuDriver,
    GpuPath,
    GpuSupport,
    choose_gpu_path,
    device_pointer,
    is_cuda_buffer,
    probe_gpu_support,
)
from kvpool.transfer.registry import TransportSet
from kvpool.transfer.verbs import buffer_address

if TYPE_CHECKING:  # imported when first used: a client without CUDA buffers does not load the RDMA client
    from kvpool.transfer.rdma_client import RdmaTransport
    from kvpool.transfer.rdma_rails import RailsTransport

logger = get_logger(__name__)

NO_RDMA_LOG_KEY = "kvpool.client.cuda.no_rdma"
REGISTRATION_LOG_KEY = "kvpool.client.cuda.registration"
_HOST_TYPES = frozenset({memoryview, bytes, bytearray})
_STAGING_KEEP = 64 << 20
"""The largest staging buffer a client keeps between calls; a larger call stages through one of its own."""
_HASH_CHUNK = 8 << 20
_PATH_FAILURES = frozenset({ErrorCode.TRANSFER_FAILED, ErrorCode.CONNECTION_FAILED})


class DeviceMemoryOps(Protocol):
    """The GPU copies and reads the client needs (:class:`TorchDeviceOps`; tests pass a FAKE)."""

    def host_buffer(self, nbytes: int) -> memoryview:
        """Pinned host memory of ``nbytes`` (kept alive by the view)."""
        ...

    def to_host(self, address: int, host: memoryview) -> None:
        """Start copying ``len(host)`` bytes from device ``address`` into ``host`` (asynchronous)."""
        ...

    def from_host(self, host: memoryview, address: int) -> None:
        """Start copying ``host`` to device ``address`` (asynchronous)."""
        ...

    def synchronize(self) -> None:
        """Wait for the copies started so far, and for the work queued before them on the stream."""
        ...

    def checksum(self, address: int, nbytes: int) -> int:
        """The object checksum (xxh3-64) of ``nbytes`` of device memory, read through host memory."""
        ...


def find_cuda(buffers: Sequence[Buffer]) -> dict[int, tuple[int, int]] | None:
    """The CUDA buffers among ``buffers``: position -> (device address, bytes); None when there are none
    (the common case, decided by type for bytes, bytearray and memoryview)."""
    if _HOST_TYPES.issuperset(map(type, buffers)):
        return None
    found: dict[int, tuple[int, int]] | None = None
    for position, buffer in enumerate(buffers):
        if type(buffer) in _HOST_TYPES or not is_cuda_buffer(buffer):
            continue
        if found is None:
            found = {}
        found[position] = device_pointer(buffer)
    return found


class DeviceBuffers:
    """A client's handling of CUDA buffers: the path, the registrations, the staging buffer, the counters."""

    def __init__(self, transports: TransportSet) -> None:
        self._transports = transports
        self._support: GpuSupport | None = None
        self._driver: GpuDriver | None = None
        self._ops: DeviceMemoryOps | None = None
        self._staging_lock = threading.Lock()
        self._staging: memoryview | None = None
        self._counts_lock = threading.Lock()
        self.bytes_by_path = {GpuPath.DMABUF.value: 0, GpuPath.PEERMEM.value: 0, GpuPath.STAGING.value: 0}
        """Payload bytes of CUDA buffers moved OK, by path (``STAGING``: every byte that went through host
        memory, the bounces of the direct paths included)."""
        self._no_speculation = SpeculativeReads(0, SYSTEM_CLOCK)

    def use(
        self,
        *,
        support: GpuSupport | None = None,
        driver: GpuDriver | None = None,
        ops: DeviceMemoryOps | None = None,
    ) -> None:
        """Replace what is probed on first use: the host's GPU support, the driver, the device copies."""
        self._support = support or self._support
        self._driver = driver or self._driver
        self._ops = ops or self._ops

    def metrics(self) -> dict[str, int]:
        with self._counts_lock:
            return {f"gpu_bytes_{path}": n for path, n in self.bytes_by_path.items()}

    # ---- the calls
    def put(
        self,
        client: Any,
        keys: Sequence[str],
        buffers: Sequence[Buffer],
        cuda: dict[int, tuple[int, int]],
        config: PutConfig | None,
        timeout: float | None,
    ) -> list[int]:
        """``client.batch_put_from`` with the CUDA buffers at the positions of ``cuda``."""
        # The kernels that produced the tensors are done before the NIC reads them; a CUDA runtime call also
        # makes the device's context current on this thread, which the driver calls below need.
        self.ops.synchronize()
        allocations = self._allocations(cuda)
        path = self._path(buffers, cuda)
        if path is not GpuPath.STAGING and self._register(allocations, path):
            worker, views, device_set = self._worker(client, buffers, cuda, path)
            codes: list[int] = worker.batch_put_from(keys, views, config, timeout)
            self._count(path, device_set.direct_bytes, device_set.bounced_bytes)
            return codes
        return self._staged_put(client, keys, buffers, cuda, config, timeout)

    def get_into(
        self,
        client: Any,
        keys: Sequence[str],
        buffers: Sequence[Buffer],
        cuda: dict[int, tuple[int, int]],
        timeout: float | None,
    ) -> list[int]:
        """``client.batch_get_into`` with the CUDA buffers at the positions of ``cuda``."""
        self.ops.synchronize()  # no queued kernel still reads what is about to be overwritten (and see put)
        allocations = self._allocations(cuda)
        path = self._path(buffers, cuda)
        if path is not GpuPath.STAGING and self._register(allocations, path):
            worker, views, device_set = self._worker(client, buffers, cuda, path)
            codes: list[int] = worker.batch_get_into(keys, views, timeout)
            self.ops.synchronize()  # the bounced objects' copies to the GPU have landed
            self._count(path, device_set.direct_bytes, device_set.bounced_bytes)
            return codes
        return self._staged_get(client, keys, buffers, cuda, timeout)

    # ---- which path
    @property
    def ops(self) -> DeviceMemoryOps:
        if self._ops is None:
            self._ops = TorchDeviceOps()
        return self._ops

    def _rdma(self) -> RdmaTransport | RailsTransport | None:
        from kvpool.transfer.rdma_client import RdmaTransport
        from kvpool.transfer.rdma_rails import RailsTransport

        rdma = self._transports.transport("rdma")
        return rdma if isinstance(rdma, RdmaTransport | RailsTransport) else None

    def _path(self, buffers: Sequence[Buffer], cuda: dict[int, tuple[int, int]]) -> GpuPath:
        if self._rdma() is None:
            log_once(
                logger,
                logging.INFO,
                NO_RDMA_LOG_KEY,
                "no RDMA transport: CUDA buffers are staged through pinned host memory",
            )
            return GpuPath.STAGING
        if self._support is None:
            self._support = probe_gpu_support()
        return choose_gpu_path(buffers[next(iter(cuda))], self._support)

    def _allocations(self, cuda: dict[int, tuple[int, int]]) -> list[DeviceAllocation]:
        """The driver's allocations holding the call's CUDA buffers, each once; KvPoolError(INVALID_ARGUMENT)
        for a buffer that is no device memory or that claims bytes past its allocation (no copy and no MR may
        reach beyond it)."""
        if self._driver is None:
            self._driver = CudaDriver()
        found: dict[int, DeviceAllocation] = {}
        for address, nbytes in cuda.values():
            allocation = self._driver.allocation(address)
            if address + nbytes > allocation.base + allocation.size:
                raise KvPoolError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"a CUDA buffer of {nbytes} bytes at {address:#x} runs past its allocation "
                    f"[{allocation.base:#x}, +{allocation.size})",
                )
            found[allocation.base] = allocation
        return list(found.values())

    def _register(self, allocations: list[DeviceAllocation], path: GpuPath) -> bool:
        """Register the allocations of the call's CUDA buffers with every RDMA rail (cached there); False,
        said once, when that failed: the call is staged."""
        rdma = self._rdma()
        assert rdma is not None  # _path chose a direct path
        driver = self._driver
        assert driver is not None  # _allocations loaded it
        try:
            for allocation in allocations:
                export = partial(driver.export_dmabuf, allocation) if path is GpuPath.DMABUF else None
                rdma.register_device_memory(allocation.base, allocation.size, allocation.buffer_id, export)
        except KvPoolError as exc:
            # The host offered the path but it does not work (a driver that exports no dma-buf, a NIC that
            # refuses the registration): later calls take the next path instead of failing again each time.
            support = self._support or GpuSupport(False, False)
            why = f"{path.value} registration failed: {exc}"
            self._support = GpuSupport(False, support.peermem and path is GpuPath.DMABUF, why)
            log_once(
                logger,
                logging.WARNING,
                f"{REGISTRATION_LOG_KEY}.{path.value}",
                "cannot register GPU memory for RDMA (%s): this call is staged through host memory",
                exc,
            )
            return False
        return True

    def register(self, buffer: Buffer) -> None:
        """``register_buffer`` of a CUDA buffer: its allocation registered with RDMA now rather than on first
        use (nothing to do where it would be staged)."""
        cuda = find_cuda([buffer])
        if cuda is not None:
            self.ops.synchronize()  # the device's context current on this thread (see put)
            allocations = self._allocations(cuda)
            path = self._path([buffer], cuda)
            if path is not GpuPath.STAGING:
                self._register(allocations, path)

    def _worker(
        self, client: Any, buffers: Sequence[Buffer], cuda: dict[int, tuple[int, int]], path: GpuPath
    ) -> tuple[Any, list[Buffer], DeviceTransportSet]:
        """A shallow copy of the client (its master, lease cache and counters shared) whose transport set
        keeps GPU memory on RDMA and which reads nothing by key (that lands over TCP)."""
        views: list[Buffer] = list(buffers)
        for position, (address, nbytes) in cuda.items():
            views[position] = ptr_view(address, nbytes)
        rdma = self._rdma()
        assert rdma is not None  # _path chose a direct path
        device_set = DeviceTransportSet(
            self._transports, rdma, {address for address, _ in cuda.values()}, self.ops, path
        )
        worker = copy.copy(client)
        worker._transports = device_set
        worker._speculation = self._no_speculation
        return worker, views, device_set

    def _count(self, path: GpuPath, direct: int, bounced: int) -> None:
        with self._counts_lock:
            self.bytes_by_path[path.value] += direct
            self.bytes_by_path[GpuPath.STAGING.value] += bounced

    # ---- staging
    def _host(self, nbytes: int) -> memoryview:
        if nbytes > _STAGING_KEEP:
            return self.ops.host_buffer(nbytes)
        if self._staging is None or len(self._staging) < nbytes:
            self._staging = self.ops.host_buffer(max(nbytes, 1 << 20))
        return self._staging

    def _staging_views(self, buffers: Sequence[Buffer], cuda: dict[int, tuple[int, int]]) -> list[Buffer]:
        """The call's buffers with each CUDA one replaced by its own slice of the pinned staging buffer
        (called under the staging lock: the slices stay the call's until it ends)."""
        host = self._host(sum(n for _, n in cuda.values()))
        views: list[Buffer] = list(buffers)
        offset = 0
        for position, (_, nbytes) in cuda.items():
            views[position] = host[offset : offset + nbytes]
            offset += nbytes
        return views

    def _staged_put(
        self,
        client: Any,
        keys: Sequence[str],
        buffers: Sequence[Buffer],
        cuda: dict[int, tuple[int, int]],
        config: PutConfig | None,
        timeout: float | None,
    ) -> list[int]:
        ops = self.ops
        with self._staging_lock:
            views = self._staging_views(buffers, cuda)
            for position, (address, _) in cuda.items():
                ops.to_host(address, views[position])
            ops.synchronize()
            codes: list[int] = client.batch_put_from(keys, views, config, timeout)
        self._count(GpuPath.STAGING, 0, sum(n for p, (_, n) in cuda.items() if codes[p] == 0))
        return codes

    def _staged_get(
        self,
        client: Any,
        keys: Sequence[str],
        buffers: Sequence[Buffer],
        cuda: dict[int, tuple[int, int]],
        timeout: float | None,
    ) -> list[int]:
        ops = self.ops
        with self._staging_lock:
            views = self._staging_views(buffers, cuda)
            codes: list[int] = client.batch_get_into(keys, views, timeout)
            ops.synchronize()  # no queued kernel still reads what the copies are about to overwrite
            for position, (address, _) in cuda.items():
                if codes[position] > 0:
                    ops.from_host(views[position][: codes[position]], address)
            ops.synchronize()
        self._count(GpuPath.STAGING, 0, sum(max(0, codes[p]) for p in cuda))
        return codes


class DeviceTransportSet(TransportSet):
    """The client's transports for one call with CUDA buffers on a direct path: a request on GPU memory goes
    over RDMA, whose NIC reaches that memory, or - where RDMA cannot serve it or lost it to its path - through
    a host bounce buffer over the client's ordinary transports. Requests on host memory are unchanged.
    Bytes are counted into the client's own figures (``bytes_rdma``, ...)."""

    def __init__(
        self, host: TransportSet, rdma: Transport, devices: set[int], ops: DeviceMemoryOps, path: GpuPath
    ) -> None:
        super().__init__(host._transports, host._node)
        self._bytes, self._bytes_lock = host._bytes, host._bytes_lock  # the client's byte counters
        self._rdma = rdma
        self._devices = devices
        self._ops = ops
        self.path = path
        self.direct_bytes = 0
        self.bounced_bytes = 0
        self._settled: set[int] = set()  # ids of the LazyChecksums given a value already

    def _on_device(self, request: TransferRequest) -> bool:
        return buffer_address(request.buffer) in self._devices

    def transfer(self, requests: Sequence[TransferRequest], deadline: Deadline) -> list[ErrorCode]:
        codes = [ErrorCode.INTERNAL] * len(requests)
        direct: list[int] = []
        rest: list[int] = []
        for position, request in enumerate(requests):
            on_rdma = self._on_device(request) and not request.revalidate and self._rdma.can_reach(request.replica)
            (direct if on_rdma else rest).append(position)
        if direct:
            rest.extend(self._direct(requests, direct, codes, deadline))
        if rest:
            self._through_host(requests, sorted(rest), codes, deadline)
        return codes

    def _direct(
        self, requests: Sequence[TransferRequest], positions: list[int], codes: list[ErrorCode], deadline: Deadline
    ) -> list[int]:
        """NIC<->GPU; returns the positions RDMA lost to its path (they go through host memory)."""
        group = [requests[p] for p in positions]
        for request in group:
            if request.op == GrantOp.WRITE:
                address, nbytes = buffer_address(request.buffer), len(request.buffer)
                self._settle(request, partial(self._ops.checksum, address, nbytes))
        # The transport must not hash GPU memory: verification is done here, through host memory.
        got = self._rdma.transfer([r._replace(verify=False) for r in group], deadline)
        lost = []
        for position, request, code in zip(positions, group, got, strict=True):
            if code == ErrorCode.OK and request.op == GrantOp.READ and request.verify:
                landed = self._ops.checksum(buffer_address(request.buffer), request.replica.length)
                code = ErrorCode.OK if landed == checksum_value(request.checksum) else ErrorCode.CHECKSUM_MISMATCH
            if code in _PATH_FAILURES:
                lost.append(position)
                continue
            codes[position] = code
            if code == ErrorCode.OK:
                self.direct_bytes += request.replica.length
        self._counted(self._rdma, group, [codes[p] if p not in lost else ErrorCode.INTERNAL for p in positions])
        return lost

    def _through_host(
        self, requests: Sequence[TransferRequest], positions: list[int], codes: list[ErrorCode], deadline: Deadline
    ) -> None:
        """The client's ordinary transports, GPU memory bounced through host buffers."""
        group: list[TransferRequest] = []
        bounced: dict[int, memoryview] = {}  # position -> its host bounce buffer
        for position in positions:
            request = requests[position]
            if not self._on_device(request):
                group.append(request)
                continue
            host = memoryview(bytearray(len(request.buffer)))
            if request.op == GrantOp.WRITE:
                self._ops.to_host(buffer_address(request.buffer), host)
            bounced[position] = host
            group.append(request._replace(buffer=host))
        if bounced:
            self._ops.synchronize()
        for request, position in zip(group, positions, strict=True):
            bounce = bounced.get(position)
            if bounce is not None and request.op == GrantOp.WRITE:
                self._settle(request, partial(checksum, bounce))
        got = super().transfer(group, deadline)
        for position, code in zip(positions, got, strict=True):
            codes[position] = code
            landed = bounced.get(position)
            if landed is not None and code == ErrorCode.OK:
                if requests[position].op == GrantOp.READ:
                    length = requests[position].replica.length
                    self._ops.from_host(landed[:length], buffer_address(requests[position].buffer))
                self.bounced_bytes += requests[position].replica.length

    def _settle(self, request: TransferRequest, compute: Callable[[], int]) -> None:
        """Give a write's LazyChecksum its value before any transport asks it to hash GPU memory."""
        lazy = request.checksum
        if isinstance(lazy, LazyChecksum) and id(lazy) not in self._settled:
            lazy.settle(compute())
            self._settled.add(id(lazy))


class _RawCudaArray:
    """A device range as ``__cuda_array_interface__``, so that torch wraps a raw device pointer."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


class TorchDeviceOps:
    """:class:`DeviceMemoryOps` with torch: copies on the current CUDA stream of the buffer's device (so after the
    kernels queued there), pinned host memory, checksums through a pinned scratch buffer."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._scratch: Any = None
        self._devices: set[Any] = set()  # devices with copies started since the last synchronize
        self._devices_lock = threading.Lock()
        self._hash_lock = threading.Lock()  # one pinned scratch buffer for every thread's checksums

    def _device(self, address: int, nbytes: int) -> Any:
        """The device bytes as a torch tensor on the device that holds them, sharing their memory."""
        tensor = self._torch.as_tensor(_RawCudaArray(address, nbytes))
        if not tensor.is_cuda or tensor.data_ptr() != address:
            raise KvPoolError(ErrorCode.INTERNAL, f"torch did not wrap device memory at {address:#x} in place")
        with self._devices_lock:
            self._devices.add(tensor.device)
        return tensor

    def host_buffer(self, nbytes: int) -> memoryview:
        tensor = self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)
        array: Any = tensor.numpy()  # shares the pinned memory and keeps the tensor alive
        return memoryview(array)

    def to_host(self, address: int, host: memoryview) -> None:
        device = self._device(address, len(host))
        with self._torch.cuda.device(device.device):
            self._torch.frombuffer(host, dtype=self._torch.uint8).copy_(device, non_blocking=True)

    def from_host(self, host: memoryview, address: int) -> None:
        device = self._device(address, len(host))
        with self._torch.cuda.device(device.device):
            device.copy_(self._torch.frombuffer(host, dtype=self._torch.uint8), non_blocking=True)

    def synchronize(self) -> None:
        with self._devices_lock:
            devices, self._devices = self._devices or {self._torch.device("cuda")}, set()
        for device in devices:
            self._torch.cuda.current_stream(device).synchronize()

    def checksum(self, address: int, nbytes: int) -> int:
        hasher = xxhash.xxh3_64()
        with self._hash_lock:
            if nbytes and self._scratch is None:
                self._scratch = self._torch.empty(_HASH_CHUNK, dtype=self._torch.uint8, pin_memory=True)
            device: Any = self._device(address, nbytes) if nbytes else None
            for start in range(0, nbytes, _HASH_CHUNK):
                n = min(_HASH_CHUNK, nbytes - start)
                self._scratch[:n].copy_(device[start : start + n])  # synchronous: the bytes are there after
                chunk: Any = self._scratch[:n].numpy()
                hasher.update(memoryview(chunk))
        return int(hasher.intdigest())
