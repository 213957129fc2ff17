"""RDMA memory registration and work-request planning: MRs of bounded size, the client's registered
buffers found by address, and the cut of one transfer into work requests at MR boundaries.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger
from kvpool.transfer.rdma_wire import RemoteRegion
from kvpool.transfer.verbs import (
    Access,
    CompletionQueue,
    DeviceContext,
    MemoryRegion,
    QueuePair,
    VerbsError,
    buffer_address,
)

logger = get_logger(__name__)


# ---------------------------------------------------------------------- memory registration
class SegmentMemory(Protocol):
    """What the responder registers: the store's segment (``view`` over its mmap, and its ``size``)."""

    @property
    def view(self) -> memoryview: ...

    @property
    def size(self) -> int: ...


def register_chunked(
    ctx: DeviceContext, address: int, length: int, access: Access, max_mr_bytes: int
) -> list[MemoryRegion]:
    """Register [address, address+length) as MRs of at most ``max_mr_bytes`` each (all or nothing)."""
    mrs: list[MemoryRegion] = []
    try:
        for start in range(0, length, max_mr_bytes):
            mrs.append(ctx.reg_mr(address + start, min(max_mr_bytes, length - start), access))
    except VerbsError:
        for mr in mrs:
            _close_quietly(mr)
        raise
    return mrs


def _close_quietly(obj: MemoryRegion | QueuePair | CompletionQueue | DeviceContext) -> None:
    try:
        obj.close()
    except VerbsError as exc:
        logger.debug("closing %s: %s", type(obj).__name__, exc)


@dataclass(eq=False, slots=True)
class _Registration:
    """A registered client buffer: its MRs (in address order) and a reference that keeps it alive."""

    addr: int
    length: int
    mrs: list[MemoryRegion]
    view: memoryview | None
    """The host buffer (kept alive while registered); None for GPU memory."""
    refs: int = 1
    iova_base: int | None = None
    """For dma-buf MRs (whose addresses are IOVAs): the virtual address of IOVA 0; None: host addressing."""
    buffer_id: int = 0
    """For GPU memory: the driver's id of the allocation (never reused), so a stale registration is seen."""

    def close(self) -> None:
        for mr in self.mrs:
            _close_quietly(mr)
        self.mrs = []

    def spans(self) -> list[tuple[int, ...]]:
        """(address, length, lkey) of each MR; for dma-buf MRs (virtual address, length, lkey, the IOVA an SGE
        gives that first byte)."""
        base = self.iova_base
        if base is None:
            return [(mr.addr, mr.length, mr.lkey) for mr in self.mrs]
        return [(base + mr.addr, mr.length, mr.lkey, mr.addr) for mr in self.mrs]


class _LocalMemory:
    """The client's registered buffers, found by address."""

    def __init__(self, ctx: DeviceContext, max_mr_bytes: int) -> None:
        self._ctx = ctx
        self._max_mr = max_mr_bytes
        self._lock = threading.Lock()
        self._regs: list[_Registration] = []  # sorted by addr

    def register(self, view: memoryview, temporary: bool = False) -> _Registration:
        addr, length = buffer_address(view), view.nbytes
        with self._lock:
            if not temporary:
                for reg in self._regs:
                    if reg.addr == addr and reg.length == length:
                        reg.refs += 1
                        return reg
        access = Access.NONE if view.readonly else Access.LOCAL_WRITE
        try:
            mrs = register_chunked(self._ctx, addr, length, access, self._max_mr)
        except VerbsError as exc:
            raise KvPoolError(
                ErrorCode.TRANSFER_FAILED,
                f"cannot register {length} bytes at {addr:#x} for RDMA: {exc} "
                "(is the memlock ulimit high enough? see docs/rdma.md)",
            ) from exc
        reg = _Registration(addr, length, mrs, view)
        if not temporary:
            with self._lock:
                keys = [r.addr for r in self._regs]
                self._regs.insert(bisect.bisect_right(keys, addr), reg)
        return reg

    def unregister(self, view: memoryview) -> bool:
        addr, length = buffer_address(view), view.nbytes
        with self._lock:
            for i, reg in enumerate(self._regs):
                if reg.addr == addr and reg.length == length:
                    reg.refs -= 1
                    if reg.refs > 0:
                        return True
                    del self._regs[i]
                    break
            else:
                return False
        reg.close()
        return True

    def register_device(
        self, base: int, size: int, buffer_id: int, export_dmabuf: Callable[[], int] | None
    ) -> _Registration:
        """Register a GPU allocation [base, base+size) once (cached until :meth:`close`): through a dma-buf
        when ``export_dmabuf`` is given (it returns an fd whose offset 0 is ``base``; closed here), else by
        ``reg_mr`` over the device pointer (nvidia-peermem). A cached registration of the same range with
        another ``buffer_id`` belongs to a freed allocation: it is dropped and the range registered again."""
        stale = None
        with self._lock:
            for i, reg in enumerate(self._regs):
                if reg.addr == base and reg.length == size and reg.view is None:
                    if reg.buffer_id == buffer_id:
                        return reg
                    stale = self._regs.pop(i)
                    break
        if stale is not None:
            stale.close()
        try:
            if export_dmabuf is None:
                mrs = register_chunked(self._ctx, base, size, Access.LOCAL_WRITE, self._max_mr)
                reg = _Registration(base, size, mrs, None, buffer_id=buffer_id)
            else:
                reg = _Registration(base, size, self._dmabuf_mrs(export_dmabuf, size), None, 1, base, buffer_id)
        except (VerbsError, OSError) as exc:
            raise KvPoolError(
                ErrorCode.TRANSFER_FAILED, f"cannot register GPU memory [{base:#x}, +{size}) for RDMA: {exc}"
            ) from exc
        with self._lock:
            keys = [r.addr for r in self._regs]
            self._regs.insert(bisect.bisect_right(keys, base), reg)
        return reg

    def _dmabuf_mrs(self, export_dmabuf: Callable[[], int], size: int) -> list[MemoryRegion]:
        """MRs of at most ``max_mr_bytes`` over one exported dma-buf, each at IOVA == its offset."""
        fd = export_dmabuf()
        mrs: list[MemoryRegion] = []
        try:
            for start in range(0, size, self._max_mr):
                n = min(self._max_mr, size - start)
                mrs.append(self._ctx.reg_dmabuf_mr(fd, start, n, start, Access.LOCAL_WRITE))
        except VerbsError:
            for mr in mrs:
                _close_quietly(mr)
            raise
        finally:
            os.close(fd)
        return mrs

    def find(self, addr: int, length: int) -> _Registration | None:
        """A registration holding all of [addr, addr+length), if any."""
        with self._lock:
            for reg in self._regs:
                if reg.addr <= addr and addr + length <= reg.addr + reg.length:
                    return reg
                if reg.addr > addr:
                    break
        return None

    def close(self) -> None:
        with self._lock:
            regs, self._regs = self._regs, []
        for reg in regs:
            reg.close()


# ---------------------------------------------------------------------- planning
@dataclass(frozen=True, slots=True)
class Piece:
    """One planned work request: ``length`` bytes at ``offset`` within the request."""

    offset: int
    length: int
    local_addr: int
    lkey: int
    remote_addr: int
    rkey: int


def plan_pieces(
    local_addr: int,
    local_spans: Sequence[tuple[int, ...]],
    remote_offset: int,
    regions: Sequence[RemoteRegion],
    length: int,
    max_chunk: int,
) -> list[Piece]:
    """Cut a transfer of ``length`` bytes at every local MR boundary, remote MR boundary and ``max_chunk``.

    ``local_spans`` are the (addr, length, lkey[, sge_addr]) of the MRs holding the local range (``sge_addr``:
    what an SGE names the span's first byte, its IOVA for a dma-buf MR; the address itself when absent),
    ``regions`` the MRs of the remote segment. Raises KvPoolError(OUT_OF_BOUNDS) when a byte is in no remote region and
    KvPoolError(INTERNAL) when a byte is in no local MR (the caller registered the buffer first).
    """
    pieces: list[Piece] = []
    pos = 0
    while pos < length:
        la, ro = local_addr + pos, remote_offset + pos
        span = next((s for s in local_spans if s[0] <= la < s[0] + s[1]), None)
        if span is None:
            raise KvPoolError(ErrorCode.INTERNAL, f"local address {la:#x} is in no registered MR")
        region = next((r for r in regions if r.offset <= ro < r.offset + r.length), None)
        if region is None:
            raise KvPoolError(ErrorCode.OUT_OF_BOUNDS, f"segment offset {ro} is in no registered region")
        n = min(length - pos, span[0] + span[1] - la, region.offset + region.length - ro, max_chunk)
        sge = la if len(span) < 4 else span[3] + (la - span[0])
        pieces.append(Piece(pos, n, sge, span[2], region.addr + (ro - region.offset), region.rkey))
        pos += n
    return pieces
