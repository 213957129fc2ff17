"""A FAKE verbs layer: devices, PDs, MRs, CQs and RC queue pairs simulated in one process.

This is a test double, not a transport: nothing leaves the process. It exists because the team's machines
have no RDMA device and cannot load Soft-RoCE (the kernel has no modules), yet the RDMA transport's logic -
QP state machine, MR bookkeeping and limits, chunking over MR boundaries, completion handling, teardown and
reconnect - must be exercised on every test run. It simulates what that logic depends on:

* devices with a ``max_mr_size``, a port (LID, GID, MTU) and a send-queue depth limit;
* MRs with distinct lkey/rkey, access flags, and length limits (registration refused beyond ``max_mr_bytes``);
* dma-buf MRs (``reg_dmabuf_mr``, GPU memory) addressed by IOVA: an SGE outside [iova, iova+length) is refused,
  one inside reaches the fake's own mapping of the dma-buf fd (decision 0023);
* RC QPs with the RESET -> INIT -> RTR -> RTS state machine (:data:`kvpool.transfer.verbs.LEGAL_TRANSITIONS`);
  posting on a QP that is not RTS is refused, posting on an ERR QP completes with WR_FLUSH_ERR;
* one-sided RDMA READ/WRITE by ``memmove`` between registered regions of two "nodes" (two contexts on the
  same :class:`FakeFabric`), with the checks a NIC makes: the lkey covers the local range, the peer QP is
  connected back to us (else RETRY_EXC_ERR), the rkey covers the remote range and the peer QP and MR allow
  the access (else REM_ACCESS_ERR, and both QPs go to ERR as on an RC connection);
* injectable failures (:class:`Faults`): device listing that raises, refused registrations, refused posts,
  error completions, lost completions (a hang, for timeouts), refused state transitions, and
  :meth:`FakeFabric.break_qps` (an asynchronous fatal error on every QP).

Completions are generated when the work request is posted (the copy is synchronous); they are delivered
when the CQ is polled, and a QP's send-queue slot is freed only then, as with real hardware.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from kvpool.transfer.verbs import (
    Access,
    Completion,
    CompletionQueue,
    DeviceContext,
    MemoryRegion,
    Mtu,
    Opcode,
    PortInfo,
    QpInfo,
    QpState,
    QueuePair,
    Verbs,
    VerbsError,
    WcStatus,
    WorkRequest,
    check_transition,
)

if TYPE_CHECKING:
    from kvpool.transfer.verbs_native import WindowBinder

_MrT = TypeVar("_MrT", bound="FakeMR")
_RESPONDER_STATES = frozenset({QpState.RTR, QpState.RTS, QpState.SQD})
MAX_MSG_BYTES = 1 << 31  # a port's max_msg_sz: one work request moves at most 2 GiB


@dataclass
class Faults:
    """Failures to inject; each counter is consumed as the failure fires."""

    list_devices_error: Exception | None = None
    """``list_devices`` raises this (e.g. what Debian's pyverbs raises without a device)."""
    reg_mr_failures: int = 0
    """The next N registrations fail with ENOMEM (as with a too-small memlock ulimit)."""
    post_failures: int = 0
    """The next N ``post_send`` calls fail with ENOMEM."""
    completion_errors: list[WcStatus] = field(default_factory=list)
    """The next work requests complete with these statuses (nothing is copied; the QP goes to ERR)."""
    drop_completions: int = 0
    """The next N work requests never complete (a lost response: the caller must time out)."""
    modify_failures: int = 0
    """The next N QP state transitions fail with EIO."""


class FakeFabric:
    """The "wire" between fake devices: QPs are found by (GID, QP number) and bytes are copied directly."""

    def __init__(self) -> None:
        self.nic_seconds = 0.0
        """Time spent inside the fake NIC (checks and byte copies): ``post_us_per_wr`` takes it out."""
        self.lock = threading.RLock()
        self.faults = Faults()
        self.posted: list[WorkRequest] = []
        """Every work request posted on any QP, in order (tests count and inspect them)."""
        self.bytes_moved = 0
        self.dmabuf_bytes = 0
        """Bytes whose local side was a dma-buf MR (GPU memory in IOVA terms; tests prove that path with it)."""
        self._qps: dict[tuple[str, int], FakeQP] = {}
        self._next_qpn = 0x11
        self._next_key = 0x1000
        self._next_port = 1

    def qp_count(self) -> int:
        with self.lock:
            return len(self._qps)

    def break_qps(self) -> int:
        """Move every QP to ERR (an async fatal event: link flap, device reset); returns how many."""
        with self.lock:
            qps = list(self._qps.values())
            for qp in qps:
                qp.force_error()
            return len(qps)

    # ---- used by the fake objects
    def new_qpn(self) -> int:
        with self.lock:
            self._next_qpn += 1
            return self._next_qpn

    def new_key(self) -> int:
        with self.lock:
            self._next_key += 0x101
            return self._next_key

    def new_port_id(self) -> int:
        with self.lock:
            self._next_port += 1
            return self._next_port

    def add_qp(self, qp: FakeQP) -> None:
        with self.lock:
            self._qps[(qp.ctx.gid, qp.qp_num)] = qp

    def remove_qp(self, qp: FakeQP) -> None:
        with self.lock:
            self._qps.pop((qp.ctx.gid, qp.qp_num), None)

    def find_qp(self, gid: str, qp_num: int) -> FakeQP | None:
        return self._qps.get((gid, qp_num))


def _native_default() -> bool:
    try:
        from kvpool.transfer.verbs_native import native_fake_default
    except ImportError:
        return False
    return native_fake_default()


class FakeVerbs(Verbs):
    """A fake verbs library. Two instances on one fabric are two nodes that can reach each other."""

    name = "fake"

    def __init__(
        self,
        fabric: FakeFabric | None = None,
        devices: tuple[str, ...] = ("fake_mlx5_0",),
        max_mr_bytes: int = 1 << 30,
        max_qp_wr: int = 1024,
        mtu: Mtu = Mtu.MTU_4096,
        numa_nodes: dict[str, int] | None = None,
        native: bool | None = None,
    ) -> None:
        self.fabric = fabric if fabric is not None else FakeFabric()
        self.native = _native_default() if native is None else native
        """Post through the compiled layer's fake provider (decision 0027; default: where it is built)."""
        self.devices = devices
        self.numa_nodes = dict(numa_nodes or {})
        """The NUMA node each fake device claims to sit on (unknown: -1)."""
        self.max_mr_bytes = max_mr_bytes
        self.max_qp_wr = max_qp_wr
        self.mtu = mtu
        self.contexts: list[FakeContext] = []

    def list_devices(self) -> list[str]:
        error = self.fabric.faults.list_devices_error
        if error is not None:
            raise error
        return list(self.devices)

    def numa_node(self, device: str) -> int:
        return self.numa_nodes.get(device, -1)

    def open(self, device: str, port: int = 1, gid_index: int = 0) -> FakeContext:
        if device not in self.devices:
            raise VerbsError(
                f"no RDMA device named {device!r} (have {', '.join(self.devices) or 'none'})", errno.ENODEV
            )
        if port != 1:
            raise VerbsError(f"device {device} has no port {port}", errno.EINVAL)
        ctx = FakeContext(self, device, gid_index)
        self.contexts.append(ctx)
        return ctx


class FakeContext(DeviceContext):
    """An opened fake device port and its protection domain (one PD per context)."""

    def __init__(self, verbs: FakeVerbs, device: str, gid_index: int) -> None:
        self.verbs = verbs
        self.fabric = verbs.fabric
        self.name = device
        self.port = 1
        self.gid_index = gid_index
        self.lid = self.fabric.new_port_id()
        self.gid = f"fe80:0000:0000:0000:0000:0000:0000:{self.lid:04x}"
        self._by_lkey: dict[int, FakeMR] = {}
        self._by_rkey: dict[int, FakeMR] = {}
        self.qps: list[FakeQP] = []
        self.closed = False
        self._binder: WindowBinder | None = None
        """Binds windows through the compiled fake provider (decision 0027), made at the first such bind."""

    @property
    def max_mr_bytes(self) -> int:
        return self.verbs.max_mr_bytes

    @property
    def max_qp_wr(self) -> int:
        return self.verbs.max_qp_wr

    @property
    def mr_count(self) -> int:
        return len(self._by_lkey)

    def port_info(self) -> PortInfo:
        return PortInfo(lid=self.lid, gid=self.gid, mtu=self.verbs.mtu)

    def _admit_mr(self, length: int) -> None:
        """What the device refuses for any MR (held under the fabric lock): one over max_mr_size, and an
        injected pinning failure."""
        if length > self.max_mr_bytes:
            raise VerbsError(f"MR of {length} bytes exceeds the device's max_mr_size {self.max_mr_bytes}", errno.EINVAL)
        faults = self.fabric.faults
        if faults.reg_mr_failures > 0:
            faults.reg_mr_failures -= 1
            raise VerbsError("cannot pin memory (injected; as with a small memlock ulimit)", errno.ENOMEM)

    def _record_mr(self, mr: _MrT) -> _MrT:
        self._by_lkey[mr.lkey] = mr
        self._by_rkey[mr.rkey] = mr
        return mr

    def reg_mr(self, address: int, length: int, access: Access) -> FakeMR:
        with self.fabric.lock:
            self._check_open()
            if length <= 0 or address <= 0:
                raise VerbsError(f"cannot register {length} bytes at {address:#x}", errno.EINVAL)
            self._admit_mr(length)
            mr = FakeMR(self, address, length, access, self.fabric.new_key(), self.fabric.new_key())
            return self._record_mr(mr)

    def reg_dmabuf_mr(self, fd: int, offset: int, length: int, iova: int, access: Access) -> FakeDmabufMR:
        """A dma-buf MR: the fake maps the dma-buf (any mappable fd, e.g. a memfd standing in for GPU memory)
        and answers SGEs in IOVA terms, [iova, iova+length), as a NIC does. Local access only: a peer's fake
        NIC addresses memory by virtual address."""
        with self.fabric.lock:
            self._check_open()
            if access & (Access.REMOTE_READ | Access.REMOTE_WRITE):
                raise VerbsError("fake NIC: dma-buf MRs are for local access only", errno.EOPNOTSUPP)
            try:
                size = os.fstat(fd).st_size
            except OSError as exc:
                raise VerbsError(f"dma-buf fd {fd}: {exc}", errno.EBADF) from exc
            if length <= 0 or offset < 0 or iova < 0 or offset + length > size:
                raise VerbsError(
                    f"cannot register {length} bytes at offset {offset} of a dma-buf of {size}", errno.EINVAL
                )
            self._admit_mr(length)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)  # holds the dma-buf as the real MR does
            mr = FakeDmabufMR(self, iova, length, access, self.fabric.new_key(), self.fabric.new_key())
            mr.attach(mapping, offset)
            return self._record_mr(mr)

    def forget_mr(self, mr: FakeMR) -> None:
        with self.fabric.lock:
            if mr.bound_qp is None:
                self._by_lkey.pop(mr.lkey, None)
            self._by_rkey.pop(mr.rkey, None)

    def local_mr(self, lkey: int, addr: int, length: int) -> FakeMR | None:
        mr = self._by_lkey.get(lkey)
        return mr if mr is not None and mr.covers(addr, length) else None

    def remote_mr(self, rkey: int, addr: int, length: int) -> FakeMR | None:
        mr = self._by_rkey.get(rkey)
        return mr if mr is not None and mr.covers(addr, length) else None

    @property
    def supports_windows(self) -> bool:
        return True

    def bind_window(self, mr: MemoryRegion, qp: QueuePair, addr: int, length: int, access: Access) -> MemoryRegion:
        """A type-2 memory window: a fresh rkey over a sub-range of ``mr``, valid only through ``qp``. On a QP
        of the compiled fake provider it is bound by an IBV_WR_BIND_MW work request posted through it (the
        compiled layer's window path, :class:`kvpool.transfer.verbs_native.WindowBinder`); else at once."""
        if self.verbs.native and self._binds_by_request(qp):
            self._check_open()
            if self._binder is None:
                from kvpool.transfer.verbs_native import fake_window_binder

                self._binder = fake_window_binder(self)
            return self._binder.bind(mr, qp, addr, length, access)
        with self.fabric.lock:
            self._check_open()
            if not isinstance(mr, FakeMR) or mr.ctx is not self or not mr.covers(addr, length) or length <= 0:
                raise VerbsError(f"cannot bind a window of {length} bytes at {addr:#x}", errno.EINVAL)
            if not mr.access & Access.MW_BIND:
                raise VerbsError("the MR was registered without MW_BIND access", errno.EINVAL)
            if not isinstance(qp, FakeQP) or qp.ctx is not self or qp.closed:
                raise VerbsError("the window's QP belongs to another context", errno.EINVAL)
            window = FakeMR(self, addr, length, access, 0, self.fabric.new_key())
            window.bound_qp = qp.qp_num
            self._by_rkey[window.rkey] = window
            return window

    @staticmethod
    def _binds_by_request(qp: QueuePair) -> bool:
        """Whether ``qp`` posts through the compiled fake provider (then windows are bound by work requests)."""
        from kvpool.transfer.verbs_native import NativeFakeQP, NativeIpcFakeQP

        return isinstance(qp, NativeFakeQP | NativeIpcFakeQP)

    def flush_windows(self) -> None:
        if self._binder is not None:
            self._binder.flush()

    # ---- what the FAKE NIC does with window work requests (the compiled fake provider's BIND_MW, LOCAL_INV)
    def bind_by_request(self, qp: FakeQP, addr: int, length: int, lkey: int, access: int, rkey: int) -> WcStatus:
        """IBV_WR_BIND_MW posted on ``qp``: the checks an HCA makes (the MR registered with MW_BIND covers the
        range, a writable window needs a locally writable MR, remote read/write only, a fresh rkey), then the
        window exists for ``qp`` alone. Called with the fabric lock held."""
        mr = self._by_lkey.get(lkey)
        remote = Access.REMOTE_READ | Access.REMOTE_WRITE
        if (
            mr is None
            or not mr.access & Access.MW_BIND
            or length <= 0
            or not mr.covers(addr, length)
            or access & ~int(remote)
            or (access & Access.REMOTE_WRITE and not mr.access & Access.LOCAL_WRITE)
            or rkey in self._by_rkey
        ):
            return WcStatus.MW_BIND_ERR
        window = FakeMR(self, addr, length, Access(access), 0, rkey)
        window.bound_qp = qp.qp_num
        self._by_rkey[rkey] = window
        return WcStatus.SUCCESS

    def invalidate_by_request(self, qp: FakeQP, rkey: int) -> WcStatus:
        """IBV_WR_LOCAL_INV posted on ``qp``: the window with ``rkey``, bound to ``qp``, stops working."""
        window = self._by_rkey.get(rkey)
        if window is None or window.bound_qp != qp.qp_num:
            return WcStatus.MW_BIND_ERR
        window.close()
        return WcStatus.SUCCESS

    def create_cq(self, depth: int) -> FakeCQ:
        self._check_open()
        if depth <= 0:
            raise VerbsError(f"CQ depth must be positive, got {depth}", errno.EINVAL)
        if self.verbs.native:
            from kvpool.transfer.verbs_native import NativeFakeCQ

            return NativeFakeCQ(self, depth)
        return FakeCQ(self, depth)

    def create_qp(self, cq: CompletionQueue, max_send_wr: int) -> FakeQP:
        self._check_open()
        if not isinstance(cq, FakeCQ) or cq.ctx is not self:
            raise VerbsError("the CQ belongs to another context", errno.EINVAL)
        if not 0 < max_send_wr <= self.max_qp_wr:
            raise VerbsError(f"max_send_wr {max_send_wr} outside 1..{self.max_qp_wr}", errno.EINVAL)
        qp = self.new_qp(cq, max_send_wr)
        self.qps.append(qp)
        self.fabric.add_qp(qp)
        return qp

    def new_qp(self, cq: FakeCQ, max_send_wr: int) -> FakeQP:
        """A QP of this context: on the compiled fake provider where the verbs say so (decision 0027)."""
        if self.verbs.native:
            from kvpool.transfer.verbs_native import NativeFakeCQ, NativeFakeQP

            if isinstance(cq, NativeFakeCQ):
                return NativeFakeQP(self, cq, max_send_wr)
        return FakeQP(self, cq, max_send_wr)

    def close(self) -> None:
        binder, self._binder = self._binder, None
        if binder is not None:  # outside the fabric lock: the binder takes its own lock first
            binder.close()
        with self.fabric.lock:
            for qp in list(self.qps):
                qp.close()
            self._by_lkey.clear()
            self._by_rkey.clear()
            self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise VerbsError(f"device context {self.name} is closed", errno.EBADF)


class FakeMR(MemoryRegion):
    def __init__(self, ctx: FakeContext, addr: int, length: int, access: Access, lkey: int, rkey: int) -> None:
        self.ctx = ctx
        self.addr = addr
        self.length = length
        self.access = access
        self.lkey = lkey
        self.rkey = rkey
        self.bound_qp: int | None = None
        """For a memory window: the only QP (of this context) through which its rkey works."""
        self.closed = False

    def covers(self, addr: int, length: int) -> bool:
        return not self.closed and self.addr <= addr and addr + length <= self.addr + self.length

    def host_address(self, addr: int) -> int:
        """Where the fake NIC finds byte ``addr`` of this MR in this process (its own address, for host memory)."""
        return addr

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.ctx.forget_mr(self)


class FakeDmabufMR(FakeMR):
    """A fake dma-buf MR: addressed by IOVA, backed by the fake NIC's own mapping of the dma-buf."""

    _mapping: mmap.mmap | None = None
    _base = 0  # the address, in this process, of IOVA ``addr``

    def attach(self, mapping: mmap.mmap, offset: int) -> None:
        anchor = ctypes.c_char.from_buffer(mapping)
        self._base = ctypes.addressof(anchor) + offset
        del anchor  # the mapping can be closed again once no ctypes object exports it
        self._mapping = mapping

    def host_address(self, addr: int) -> int:
        return self._base + (addr - self.addr)

    def close(self) -> None:
        super().close()
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None


class FakeCQ(CompletionQueue):
    def __init__(self, ctx: FakeContext, depth: int) -> None:
        self.ctx = ctx
        self.depth = depth
        self._entries: deque[tuple[FakeQP, Completion]] = deque()
        self.closed = False

    def push(self, qp: FakeQP, completion: Completion) -> None:
        self._entries.append((qp, completion))

    def poll(self, max_entries: int) -> list[Completion]:
        with self.ctx.fabric.lock:
            if self.closed:
                raise VerbsError("poll on a closed CQ", errno.EBADF)
            out: list[Completion] = []
            while self._entries and len(out) < max_entries:
                qp, completion = self._entries.popleft()
                qp.outstanding -= 1  # the send-queue slot is free once its completion is polled
                out.append(completion)
            return out

    def close(self) -> None:
        self.closed = True


class FakeQP(QueuePair):
    def __init__(self, ctx: FakeContext, cq: FakeCQ, max_send_wr: int) -> None:
        self.ctx = ctx
        self.cq = cq
        self.max_send_wr = max_send_wr
        self.outstanding = 0
        self.access = Access.NONE
        self.remote: tuple[str, int] | None = None
        self.mtu: Mtu | None = None
        self.sq_psn = -1
        self.rq_psn = -1
        self._lost: list[WorkRequest] = []  # dropped work requests: flushed when the QP enters ERR
        self._state = QpState.RESET
        self._num = ctx.fabric.new_qpn()
        self.closed = False

    @property
    def qp_num(self) -> int:
        return self._num

    @property
    def state(self) -> QpState:
        return self._state

    # ---- state machine
    def _move(self, target: QpState) -> None:
        with self.ctx.fabric.lock:
            if self.closed:
                raise VerbsError(f"QP {self._num} is destroyed", errno.EBADF)
            check_transition(self._state, target)
            faults = self.ctx.fabric.faults
            if faults.modify_failures > 0:
                faults.modify_failures -= 1
                raise VerbsError(f"QP {self._num} -> {target.name} failed (injected)", errno.EIO)
            self._state = target

    def to_init(self, access: Access) -> None:
        self._move(QpState.INIT)
        self.access = access

    def to_rtr(self, remote: QpInfo, mtu: Mtu) -> None:
        if mtu > self.ctx.verbs.mtu:
            raise VerbsError(f"path MTU {mtu.name} above the port's {self.ctx.verbs.mtu.name}", errno.EINVAL)
        self._move(QpState.RTR)
        self.remote = (remote.gid, remote.qp_num)
        self.rq_psn = remote.psn
        self.mtu = mtu

    def to_rts(self, psn: int) -> None:
        self._move(QpState.RTS)
        self.sq_psn = psn

    def to_error(self) -> None:
        self._move(QpState.ERR)
        self._flush_lost()

    def force_error(self) -> None:
        """An asynchronous error (not a verb): the QP is in ERR whatever its state was."""
        self._state = QpState.ERR
        self._flush_lost()

    def _flush_lost(self) -> None:
        """In ERR every outstanding work request completes with WR_FLUSH_ERR - the lost ones too."""
        lost, self._lost = self._lost, []
        for wr in lost:
            self.cq.push(self, Completion(wr.wr_id, WcStatus.WR_FLUSH_ERR))

    # ---- data path
    def post_send(self, wr: WorkRequest) -> None:
        with self.ctx.fabric.lock:
            self._admit(wr)
            self._run_all((wr,))

    def post_send_list(self, wrs: Sequence[WorkRequest]) -> int:
        """Like a chained ``ibv_post_send``: the checks and the queueing under one lock for the whole list,
        then the NIC's work on the accepted ones (timed once for the list)."""
        self.last_post_error = None
        posted = len(wrs)
        with self.ctx.fabric.lock:
            for n, wr in enumerate(wrs):
                try:
                    self._admit(wr)
                except VerbsError as exc:
                    self.last_post_error = exc
                    posted = n
                    break
            self._run_all(wrs[:posted])
        return posted

    def _admit(self, wr: WorkRequest) -> None:
        """The checks a post makes before the WR is queued (called with the fabric lock held)."""
        fabric = self.ctx.fabric
        if self.closed:
            raise VerbsError(f"QP {self._num} is destroyed", errno.EBADF)
        if fabric.faults.post_failures > 0:
            fabric.faults.post_failures -= 1
            raise VerbsError("post_send failed (injected)", errno.ENOMEM)
        if self._state not in (QpState.RTS, QpState.ERR):
            raise VerbsError(f"post_send on QP {self._num} in state {self._state.name}", errno.EINVAL)
        if self.outstanding >= self.max_send_wr:
            raise VerbsError(f"send queue of QP {self._num} is full ({self.max_send_wr})", errno.ENOMEM)
        self.outstanding += 1
        fabric.posted.append(wr)

    def _run_all(self, wrs: Sequence[WorkRequest]) -> None:
        """What the NIC does with posted requests - checks, copy, completion - timed as the NIC's share
        (``nic_seconds``; a real NIC does this without the client's CPU)."""
        started = time.thread_time()
        try:
            for wr in wrs:
                self._run(wr)
        finally:
            self.ctx.fabric.nic_seconds += time.thread_time() - started

    def _run(self, wr: WorkRequest) -> None:
        faults = self.ctx.fabric.faults
        if self._state == QpState.ERR:
            self.cq.push(self, Completion(wr.wr_id, WcStatus.WR_FLUSH_ERR))
            return
        if faults.drop_completions > 0:
            faults.drop_completions -= 1
            self._lost.append(wr)  # the request vanishes: no completion until the QP is flushed
            return
        if faults.completion_errors:
            self._fail(wr, faults.completion_errors.pop(0))
            return
        status = self._execute(wr)
        if status == WcStatus.SUCCESS:
            self.cq.push(self, Completion(wr.wr_id, status, wr.length))
        else:
            self._fail(wr, status)

    def run_window_request(
        self, wr_id: int, bind: bool, addr: int, length: int, lkey: int, access: int, rkey: int
    ) -> None:
        """A BIND_MW (``bind``) or LOCAL_INV work request the fake provider recorded for this QP: a failed one
        completes with MW_BIND_ERR and moves the QP to ERR, as on an HCA."""
        if self._state == QpState.ERR:
            self.cq.push(self, Completion(wr_id, WcStatus.WR_FLUSH_ERR))
            return
        if bind:
            status = self.ctx.bind_by_request(self, addr, length, lkey, access, rkey)
        else:
            status = self.ctx.invalidate_by_request(self, rkey)
        self.cq.push(self, Completion(wr_id, status))
        if status != WcStatus.SUCCESS:
            self.force_error()

    def _fail(self, wr: WorkRequest, status: WcStatus) -> None:
        self.cq.push(self, Completion(wr.wr_id, status))
        self.force_error()

    def _execute(self, wr: WorkRequest) -> WcStatus:
        """What the NIC checks, then the copy."""
        if wr.length > MAX_MSG_BYTES:
            return WcStatus.LOC_LEN_ERR
        local = self.ctx.local_mr(wr.lkey, wr.local_addr, wr.length)
        if local is None or (wr.opcode == Opcode.RDMA_READ and not local.access & Access.LOCAL_WRITE):
            return WcStatus.LOC_PROT_ERR
        peer = self.ctx.fabric.find_qp(*self.remote) if self.remote else None
        if peer is None or peer.state not in _RESPONDER_STATES or peer.remote != (self.ctx.gid, self._num):
            return WcStatus.RETRY_EXC_ERR  # nobody answers on the other end: the retries run out
        need = Access.REMOTE_READ if wr.opcode == Opcode.RDMA_READ else Access.REMOTE_WRITE
        remote = peer.ctx.remote_mr(wr.rkey, wr.remote_addr, wr.length)
        if remote is not None and remote.bound_qp not in (None, peer.qp_num):
            remote = None  # a window bound to another QP does not exist for this one
        if not peer.access & need or remote is None or not remote.access & need:
            peer.force_error()  # an access violation kills the responder's QP as well
            return WcStatus.REM_ACCESS_ERR
        here = local.host_address(wr.local_addr)
        if wr.opcode == Opcode.RDMA_READ:
            ctypes.memmove(here, wr.remote_addr, wr.length)
        else:
            ctypes.memmove(wr.remote_addr, here, wr.length)
        self.ctx.fabric.bytes_moved += wr.length
        if isinstance(local, FakeDmabufMR):
            self.ctx.fabric.dmabuf_bytes += wr.length
        return WcStatus.SUCCESS

    def close(self) -> None:
        with self.ctx.fabric.lock:
            if self.closed:
                return
            self.closed = True
            self._state = QpState.RESET
            self.ctx.fabric.remove_qp(self)
            if self in self.ctx.qps:
                self.ctx.qps.remove(self)
