"""The compiled verbs data path (:mod:`kvpool.transfer._verbs`, decision 0027): a :class:`Verbs` over
libibverbs that owns its device, PD, MRs, CQs and RC QPs, and posts a window of chunks as one chain of work
requests built in C (:meth:`QueuePair.post_chunks`); and the FAKE NIC's QPs and CQs on the extension's fake
provider, so that tests post through the same compiled code a real NIC's provider is called from.

Selection (``KVPOOL_VERBS``, :func:`kvpool.transfer.factory.default_verbs`): ``native`` = this module on real
devices; ``pyverbs`` = :class:`kvpool.transfer.verbs.PyverbsVerbs`; empty = this module when it is built and
finds a device, else pyverbs; ``fake`` = the FAKE NIC, posting through the extension's fake provider when it
is built (``KVPOOL_NATIVE_VERBS=0``: the Python posting path).

The real-device half has not run on an RDMA device here (the team's machines have none): it is compiled
and typed, and exercised by the opt-in hardware test only (tests/integration/test_rdma_hardware.py).
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from kvpool.common import envs
from kvpool.common.log import get_logger
from kvpool.transfer.verbs import (
    _ACK_TIMEOUT,
    _MIN_RNR_TIMER,
    _RD_ATOMIC,
    _RETRY_CNT,
    _RNR_RETRY,
    ZERO_GID,
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
from kvpool.transfer.verbs_fake import FakeContext, FakeCQ, FakeMR, FakeQP
from kvpool.transfer.verbs_fake_ipc import IpcFakeQP

if TYPE_CHECKING:
    from kvpool.transfer import _verbs
else:
    try:
        from kvpool.transfer import _verbs
    except ImportError:  # not built (no compiler or no libibverbs headers): the Python paths run
        _verbs = None

logger = get_logger(__name__)
_PACK = struct.Struct("=7Q")
_OPCODES = {int(op): op for op in Opcode}  # a dict lookup: calling the enum per work request costs microseconds
_OP_LOCAL_INV = 7  # IBV_WR_LOCAL_INV
_OP_BIND_MW = 8  # IBV_WR_BIND_MW
WINDOW_COMPLETION_TIMEOUT_S = 5.0
WINDOWS_LOG_LINE = "type-2 memory windows per grant, bound by work requests through the compiled verbs layer"
"""How long a flush waits for the completions of window binds and invalidations before it gives up on them
(they take microseconds on a NIC; a missing one means the QP or the device is broken)."""


def native_built() -> bool:
    """Whether the extension is built and importable (its libibverbs loaded)."""
    return _verbs is not None


def native_fake_default() -> bool:
    """Whether a FAKE NIC posts through the extension's fake provider by default."""
    return _verbs is not None and bool(envs.KVPOOL_NATIVE_VERBS.get())


def native_fake_work_requests() -> int:
    """Work requests this process posted through the compiled layer's fake provider so far."""
    return _NativeFakePosting.work_requests_total


def _error(what: str, exc: OSError) -> VerbsError:
    return VerbsError(f"{what}: {exc.strerror or exc}", exc.errno or 0)


def _refused(qp_num: int, err: int) -> VerbsError:
    return VerbsError(f"post_send on QP {qp_num} refused: {os.strerror(err)}", err)


def _pack(wrs: Sequence[WorkRequest]) -> bytes:
    return b"".join(
        _PACK.pack(w.wr_id, int(w.opcode), w.local_addr, w.length, w.lkey, w.remote_addr, w.rkey) for w in wrs
    )


def _type2_windows(ctx: int, device: str) -> bool:
    """Whether the device binds type-2 memory windows (``device_cap_flags`` 2A/2B and ``max_mw`` > 0)."""
    try:
        _, max_mw, type2 = _verbs.query_mw(ctx)
    except OSError as exc:
        logger.info("RDMA on %s: cannot query memory-window support (%s)", device, exc)
        return False
    return bool(type2) and max_mw > 0


def native_verbs(mode: str) -> Verbs | None:
    """The compiled layer for ``KVPOOL_VERBS`` = ``mode`` on real devices, or None (pyverbs): ``native`` asks for
    it (None, logged, where it is not built); empty prefers it where it is built and finds a device."""
    if mode not in ("", "native") or (mode == "" and not envs.KVPOOL_NATIVE_VERBS.get()):
        return None
    try:
        verbs = NativeVerbs()
        found = verbs.list_devices()
    except (ImportError, VerbsError) as exc:
        if mode == "native":
            logger.warning("KVPOOL_VERBS=native: the compiled verbs layer is unusable (%s): pyverbs instead", exc)
        return None
    return verbs if found or mode == "native" else None


# ---------------------------------------------------------------------- the real devices
class NativeVerbs(Verbs):
    """The real verbs through the compiled extension (raises ImportError where it is not built)."""

    name = "native"

    def __init__(self) -> None:
        if _verbs is None:
            raise ImportError("kvpool.transfer._verbs is not built (needs libibverbs-dev at build time)")

    def list_devices(self) -> list[str]:
        try:
            return _verbs.list_devices()
        except OSError as exc:
            raise _error("list RDMA devices", exc) from exc

    def open(self, device: str, port: int = 1, gid_index: int = 0) -> NativeContext:
        return NativeContext(device, port, gid_index)


class NativeContext(DeviceContext):
    """An opened device port with its protection domain."""

    def __init__(self, device: str, port: int, gid_index: int) -> None:
        try:
            self._ctx = _verbs.open_device(device)
        except OSError as exc:
            raise _error(f"open RDMA device {device}", exc) from exc
        try:
            self._pd = _verbs.alloc_pd(self._ctx)
            self._max_mr, self._max_qp_wr, rd_atom = _verbs.query_device(self._ctx)
        except OSError as exc:
            _verbs.close_device(self._ctx)
            raise _error(f"open RDMA device {device}", exc) from exc
        self.max_rd_atomic = max(1, min(_RD_ATOMIC, rd_atom))
        self.name = device
        self.port = port
        self.gid_index = gid_index
        self._closed = False
        self._windows_supported = _type2_windows(self._ctx, device)
        self._binder: _NativeBinder | None = None

    @property
    def max_mr_bytes(self) -> int:
        return self._max_mr

    @property
    def max_qp_wr(self) -> int:
        return self._max_qp_wr

    def port_info(self) -> PortInfo:
        try:
            lid, mtu, gid = _verbs.query_port(self._ctx, self.port, self.gid_index)
        except OSError as exc:
            raise _error(f"query port {self.name}:{self.port}", exc) from exc
        return PortInfo(lid=lid, gid=gid, mtu=Mtu.of(mtu))

    def reg_mr(self, address: int, length: int, access: Access) -> MemoryRegion:
        try:
            handle, lkey, rkey = _verbs.reg_mr(self._pd, address, length, int(access))
        except OSError as exc:
            raise _error(f"register {length} bytes at {address:#x}", exc) from exc
        return NativeMR(handle, address, length, lkey, rkey)

    @property
    def supports_windows(self) -> bool:
        """Type-2 memory windows, where the device reports them (``ibv_query_device``)."""
        return self._windows_supported

    def bind_window(self, mr: MemoryRegion, qp: QueuePair, addr: int, length: int, access: Access) -> MemoryRegion:
        if not self._windows_supported:
            return super().bind_window(mr, qp, addr, length, access)
        if self._binder is None:
            self._binder = _NativeBinder(self._pd, self.name)
        return self._binder.bind(mr, qp, addr, length, access)

    def flush_windows(self) -> None:
        if self._binder is not None:
            self._binder.flush()

    def create_cq(self, depth: int) -> CompletionQueue:
        try:
            return NativeCQ(_verbs.create_cq(self._ctx, depth), depth)
        except OSError as exc:
            raise _error(f"create a CQ of depth {depth}", exc) from exc

    def create_qp(self, cq: CompletionQueue, max_send_wr: int) -> QueuePair:
        if not isinstance(cq, NativeCQ):
            raise VerbsError("the CQ belongs to another verbs layer", errno.EINVAL)
        try:
            handle, qp_num = _verbs.create_qp(self._pd, cq.handle, max_send_wr)
        except OSError as exc:
            raise _error("create an RC QP", exc) from exc
        return NativeQP(handle, qp_num, self, cq, max_send_wr)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._binder is not None:
            self._binder.close()
        for close, handle in ((_verbs.dealloc_pd, self._pd), (_verbs.close_device, self._ctx)):
            try:
                close(handle)
            except OSError:  # something still holds the PD (a leaked MR): the process exit frees it
                continue


class NativeMR(MemoryRegion):
    def __init__(self, handle: int, addr: int, length: int, lkey: int, rkey: int) -> None:
        self._handle = handle
        self.addr = addr
        self.length = length
        self.lkey = lkey
        self.rkey = rkey

    @property
    def handle(self) -> int:
        """The ``struct ibv_mr *`` (0 once deregistered)."""
        return self._handle

    def close(self) -> None:
        handle, self._handle = self._handle, 0
        if handle:
            try:
                _verbs.dereg_mr(handle)
            except OSError as exc:
                raise _error("deregister MR", exc) from exc


class NativeCQ(CompletionQueue):
    def __init__(self, handle: int, depth: int) -> None:
        self.handle = handle
        self.depth = depth

    def poll(self, max_entries: int) -> list[Completion]:
        if not self.handle:
            raise VerbsError("poll on a closed CQ", errno.EBADF)
        try:
            polled = _verbs.poll(self.handle, max_entries)
        except OSError as exc:
            raise _error("poll CQ", exc) from exc
        return [Completion(wr_id, WcStatus.of(status), n, vendor) for wr_id, status, n, vendor in polled]

    def close(self) -> None:
        handle, self.handle = self.handle, 0
        if handle:
            try:
                _verbs.destroy_cq(handle)
            except OSError:  # a QP still uses it (EBUSY): freed with the context at exit
                return


class NativeQP(QueuePair):
    """An RC QP of the compiled layer: posts go through ``_verbs.post_chunks`` / ``post_list``."""

    def __init__(self, handle: int, qp_num: int, ctx: NativeContext, cq: NativeCQ, max_send_wr: int) -> None:
        self._handle = handle
        self._num = qp_num
        self._ctx = ctx
        self._state = QpState.RESET
        self.cq = cq
        self.max_send_wr = max_send_wr

    @property
    def handle(self) -> int:
        """The ``struct ibv_qp *`` (0 once destroyed)."""
        return self._handle

    @property
    def qp_num(self) -> int:
        return self._num

    @property
    def state(self) -> QpState:
        return self._state

    def _modify(self, target: QpState, what: str, call: Any, *args: Any) -> None:
        check_transition(self._state, target)
        try:
            call(self._handle, *args)
        except OSError as exc:
            raise _error(f"QP {self._num} {what}", exc) from exc
        self._state = target

    def to_init(self, access: Access) -> None:
        self._modify(QpState.INIT, "to_init", _verbs.modify_init, self._ctx.port, int(access))

    def to_rtr(self, remote: QpInfo, mtu: Mtu) -> None:
        global_route = bool(remote.gid) and remote.gid != ZERO_GID  # RoCE (and routed IB): a GRH to the GID
        gid = bytes.fromhex(remote.gid.replace(":", "")) if global_route else b""
        args = (self._ctx.port, self._ctx.gid_index, self._ctx.max_rd_atomic, remote.qp_num, remote.psn)
        self._modify(QpState.RTR, "to_rtr", _verbs.modify_rtr, *args, int(mtu), remote.lid, _MIN_RNR_TIMER, gid)

    def to_rts(self, psn: int) -> None:
        args = (psn, self._ctx.max_rd_atomic, _ACK_TIMEOUT, _RETRY_CNT, _RNR_RETRY)
        self._modify(QpState.RTS, "to_rts", _verbs.modify_rts, *args)

    def to_error(self) -> None:
        try:
            _verbs.modify_err(self._handle)
        except OSError as exc:
            raise _error("QP -> ERR", exc) from exc
        self._state = QpState.ERR

    def post_send(self, wr: WorkRequest) -> None:
        if self.post_send_list((wr,)) != 1:
            assert self.last_post_error is not None
            raise self.last_post_error

    def post_send_list(self, wrs: Sequence[WorkRequest]) -> int:
        self.last_post_error = None
        if not self._handle:
            self.last_post_error = VerbsError(f"QP {self._num} is destroyed", errno.EBADF)
            return 0
        posted, err = _verbs.post_list(self._handle, _pack(wrs))
        if err:
            self.last_post_error = _refused(self._num, err)
        return posted

    def post_chunks(
        self, chunks: list[Any], start: int, stop: int, first_wr_id: int, now_ms: int
    ) -> tuple[int, VerbsError | None, bool]:
        if not self._handle:
            return 0, VerbsError(f"QP {self._num} is destroyed", errno.EBADF), False
        posted, err, expired = _verbs.post_chunks(self._handle, chunks, start, stop, first_wr_id, now_ms)
        return posted, (_refused(self._num, err) if err else None), bool(expired)

    def close(self) -> None:
        handle, self._handle = self._handle, 0
        if handle:
            try:
                _verbs.destroy_qp(handle)
            except OSError as exc:
                raise _error(f"destroy QP {self._num}", exc) from exc


# ---------------------------------------------------------------------- the FAKE NIC on the fake provider
class NativeFakeCQ(FakeCQ):
    """A FAKE CQ held by the extension's fake provider: polled through ``ibv_poll_cq``, as a real one is."""

    def __init__(self, ctx: FakeContext, depth: int) -> None:
        super().__init__(ctx, depth)
        self.handle = _verbs.fake_create_cq()

    def push(self, qp: FakeQP, completion: Completion) -> None:
        if self.closed:
            return
        qp_handle = qp.native_handle if isinstance(qp, _NativeFakePosting) else 0
        _verbs.fake_complete(self.handle, qp_handle, completion.wr_id, int(completion.status), completion.byte_len)

    def poll(self, max_entries: int) -> list[Completion]:
        with self.ctx.fabric.lock:
            if self.closed:
                raise VerbsError("poll on a closed CQ", errno.EBADF)
            polled = _verbs.poll(self.handle, max_entries)
        return [Completion(wr_id, WcStatus.of(status), n, vendor) for wr_id, status, n, vendor in polled]

    def close(self) -> None:
        with self.ctx.fabric.lock:
            if not self.closed:
                self.closed = True
                _verbs.fake_destroy_cq(self.handle)


class _NativeFakePosting(FakeQP):
    """A FAKE QP whose posts go through the compiled chain and ``ibv_post_send`` into the extension's fake
    provider (state, send-queue room and injected refusals are checked there, as a provider does), after
    which the FAKE NIC takes the recorded requests and executes them - timed as the NIC's share."""

    cq: NativeFakeCQ
    work_requests_total: ClassVar[int] = 0
    """Work requests this process posted through the fake provider (tests prove a run used this path)."""

    def __init__(self, ctx: FakeContext, cq: NativeFakeCQ, max_send_wr: int) -> None:
        self.native_handle = 0
        super().__init__(ctx, cq, max_send_wr)
        self.native_handle = _verbs.fake_create_qp(cq.handle, max_send_wr, self.qp_num)
        _verbs.fake_set_state(self.native_handle, int(self._qp_state), 0)

    @property
    def _state(self) -> QpState:
        return self._qp_state

    @_state.setter
    def _state(self, value: QpState) -> None:
        self._qp_state = value
        if self.native_handle:
            _verbs.fake_set_state(self.native_handle, int(value), 0)

    def post_send(self, wr: WorkRequest) -> None:
        if self.post_send_list((wr,)) != 1:
            assert self.last_post_error is not None
            raise self.last_post_error

    def post_send_list(self, wrs: Sequence[WorkRequest]) -> int:
        self.last_post_error = None
        with self.ctx.fabric.lock:
            if self._destroyed(bool(wrs)):
                self.last_post_error = VerbsError(f"QP {self.qp_num} is destroyed", errno.EBADF)
                return 0
            posted, err = _verbs.post_list(self.native_handle, _pack(wrs))
            self.nic_takes()
        if err:
            self.last_post_error = _refused(self.qp_num, err)
        return posted

    def post_chunks(
        self, chunks: list[Any], start: int, stop: int, first_wr_id: int, now_ms: int
    ) -> tuple[int, VerbsError | None, bool]:
        with self.ctx.fabric.lock:
            if self._destroyed(stop > start):
                return 0, VerbsError(f"QP {self.qp_num} is destroyed", errno.EBADF), False
            posted, err, expired = _verbs.post_chunks(self.native_handle, chunks, start, stop, first_wr_id, now_ms)
            self.nic_takes()
        return posted, (_refused(self.qp_num, err) if err else None), bool(expired)

    def _destroyed(self, posting: bool) -> bool:
        """Whether the QP is gone; else hands the provider one injected refusal when a post is coming."""
        if self.closed or not self.native_handle:
            return True
        faults = self.ctx.fabric.faults
        if posting and faults.post_failures > 0:
            faults.post_failures -= 1
            _verbs.fake_set_state(self.native_handle, int(self._qp_state), 1)
        return False

    def nic_takes(self) -> None:
        """The FAKE NIC executes what the provider recorded: checks, copies, completions (the NIC's time)."""
        started = time.thread_time()
        try:
            for wr_id, op, laddr, n, lkey, raddr, rkey in _PACK.iter_unpack(_verbs.fake_take(self.native_handle)):
                if op in (
                    _OP_BIND_MW,
                    _OP_LOCAL_INV,
                ):  # a window request: laddr, n, lkey, raddr = addr, length, lkey, access
                    self.run_window_request(wr_id, op == _OP_BIND_MW, laddr, n, lkey, raddr, rkey)
                    continue
                wr = WorkRequest(wr_id, _OPCODES[op], laddr, n, lkey, raddr, rkey)
                self.ctx.fabric.posted.append(wr)
                _NativeFakePosting.work_requests_total += 1
                self._run(wr)
        finally:
            self.ctx.fabric.nic_seconds += time.thread_time() - started

    def close(self) -> None:
        with self.ctx.fabric.lock:
            super().close()
            handle, self.native_handle = self.native_handle, 0
            if handle:
                _verbs.fake_destroy_qp(handle, not self.cq.closed)


class NativeFakeQP(_NativeFakePosting):
    """The in-process FAKE NIC's QP on the fake provider."""


class NativeIpcFakeQP(_NativeFakePosting, IpcFakeQP):
    """The cross-process FAKE NIC's QP on the fake provider."""


# ---------------------------------------------------------------------- memory windows (type 2)
class WindowState(Enum):
    BINDING = "binding"
    """Posted; the rkey must not be advertised before the bind's successful completion."""
    BOUND = "bound"
    INVALIDATING = "invalidating"
    """Closed: a LOCAL_INV (or the bind still in flight) completes, then the window is deallocated."""
    CLOSED = "closed"
    """Deallocated (after an invalidation, a failed bind, or with its QP gone)."""


class NativeWindow(MemoryRegion):
    """A type-2 memory window bound by a work request on the QP it belongs to (decision 0020): its ``rkey``
    reaches [addr, addr + length) through that QP only. ``close()`` invalidates it; a flush of the context
    (``flush_windows``) waits for the bind's or the invalidation's completion."""

    def __init__(
        self, binder: WindowBinder, qp: QueuePair, mw: int, addr: int, length: int, rkey: int, access: Access
    ) -> None:
        self.addr = addr
        self.length = length
        self.lkey = 0
        self.rkey = rkey
        self.access = access
        self.qp = qp
        self.mw = mw
        self.state = WindowState.BINDING
        self._binder = binder

    @property
    def usable(self) -> bool:
        """Whether the bind completed successfully and the window is not invalidated: its rkey may be sent."""
        return self.state == WindowState.BOUND

    def close(self) -> None:
        self._binder.invalidate(self)


def window_usable(window: MemoryRegion) -> bool:
    """Whether a window from ``DeviceContext.bind_window`` may be advertised after ``flush_windows``: a
    compiled-layer window only once its bind completed successfully; other layers' windows at once."""
    return window.usable if isinstance(window, NativeWindow) else True


class WindowBinder:
    """Binds and invalidates type-2 windows through work requests on the QPs they belong to (IBV_WR_BIND_MW,
    IBV_WR_LOCAL_INV), and waits for their completions (:meth:`flush`). The QPs' CQ must carry nothing but
    these requests' completions (the store's QPs post nothing else). Subclasses name the provider's objects:
    :class:`_NativeBinder` (a real device) and :class:`_FakeBinder` (the fake provider)."""

    def __init__(self, pd: int, device: str) -> None:
        logger.info("RDMA on %s: %s", device, WINDOWS_LOG_LINE)
        self._pd = pd
        self._lock = threading.RLock()
        self._pending: dict[int, tuple[NativeWindow, bool, CompletionQueue]] = {}
        """wr_id -> (window, whether a bind (else an invalidation), the CQ its completion arrives on)."""
        self._next_wr_id = 1

    # ---- the provider's objects
    def qp_handle(self, qp: QueuePair) -> int:
        raise NotImplementedError

    def mr_handle(self, mr: MemoryRegion) -> int:
        raise NotImplementedError

    def qp_cq(self, qp: QueuePair) -> CompletionQueue:
        raise NotImplementedError

    def qp_depth(self, qp: QueuePair) -> int:
        raise NotImplementedError

    def post(self, qp: QueuePair, call: Callable[[], int | None]) -> int | None:
        """Post one request."""
        return call()

    def before_reap(self) -> None:
        """What must happen before completions can arrive (the fake's NIC takes what was posted)."""

    def qp_alive(self, qp: QueuePair) -> bool:
        try:
            return bool(self.qp_handle(qp))
        except VerbsError:
            return False

    # ---- binding and invalidating
    def bind(self, mr: MemoryRegion, qp: QueuePair, addr: int, length: int, access: Access) -> NativeWindow:
        if access & ~(Access.REMOTE_READ | Access.REMOTE_WRITE) or length <= 0:
            raise VerbsError(f"a window of {length} bytes with access {int(access)}: refused", errno.EINVAL)
        with self._lock:
            handle, mr_handle, cq = self.qp_handle(qp), self.mr_handle(mr), self.qp_cq(qp)
            self._make_room(qp, cq)
            try:
                mw, _ = _verbs.alloc_mw(self._pd)
            except OSError as exc:
                raise _error("allocate a memory window", exc) from exc
            wr_id = self._wr_id()
            try:
                rkey = self.post(
                    qp, lambda: _verbs.post_bind_mw(handle, mw, wr_id, mr_handle, addr, length, int(access))
                )
            except OSError as exc:
                _dealloc_quietly(mw)
                raise _error(f"bind a window of {length} bytes at {addr:#x}", exc) from exc
            assert rkey is not None
            window = NativeWindow(self, qp, mw, addr, length, rkey, access)
            self._pending[wr_id] = (window, True, cq)
            return window

    def invalidate(self, window: NativeWindow) -> None:
        """LOCAL_INV on the window's QP where it is bound and the QP can post, else deallocate at once."""
        with self._lock:
            was = window.state
            if was in (WindowState.CLOSED, WindowState.INVALIDATING):
                return
            window.state = WindowState.INVALIDATING
            if was == WindowState.BINDING:
                return  # the bind's completion deallocates it (flush)
            if was == WindowState.BOUND and window.qp.state == QpState.RTS and self._posts_local_inv(window):
                return
            self._free(window)

    def _posts_local_inv(self, window: NativeWindow) -> bool:
        try:
            handle, cq = self.qp_handle(window.qp), self.qp_cq(window.qp)
        except VerbsError:
            return False  # the QP is gone: deallocating is all that is left
        self._make_room(window.qp, cq)
        wr_id = self._wr_id()
        try:
            self.post(window.qp, lambda: _verbs.post_local_inv(handle, wr_id, window.rkey))
        except OSError as exc:
            logger.debug("rdma: LOCAL_INV of window %#x refused (%s): deallocating it", window.rkey, exc)
            return False
        self._pending[wr_id] = (window, False, cq)
        return True

    def flush(self, timeout: float = WINDOW_COMPLETION_TIMEOUT_S) -> None:
        """Wait for the completions of every bind and invalidation posted so far (a failed bind leaves its
        window unusable). Raises VerbsError when they do not all arrive within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                self.before_reap()
                if not self._reap() and not self._forget_destroyed_qps() and self._pending:
                    if time.monotonic() > deadline:
                        raise VerbsError(
                            f"{len(self._pending)} memory-window requests not completed in {timeout:.0f} s",
                            errno.ETIMEDOUT,
                        )
                    time.sleep(20e-6)  # a NIC completes a bind in microseconds; not a busy spin meanwhile

    def close(self) -> None:
        """Deallocate what is still pending (the context is closing)."""
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
            for window, _, _ in pending:
                self._free(window)

    # ---- inside (with the lock held)
    def _wr_id(self) -> int:
        wr_id = self._next_wr_id
        self._next_wr_id += 1
        return wr_id

    def _make_room(self, qp: QueuePair, cq: CompletionQueue) -> None:
        """Keep what is in flight within the QP's send queue and the CQ (an overrun CQ is fatal on a NIC)."""
        limit = min(self.qp_depth(qp), int(getattr(cq, "depth", 1)))
        if len(self._pending) >= max(1, limit):
            self.flush()

    def _reap(self) -> int:
        reaped = 0
        for cq in {id(c): c for _, _, c in self._pending.values()}.values():
            try:
                completions = cq.poll(64)
            except VerbsError:  # the CQ is gone: nothing it carried will complete
                for wr_id in [w for w, (_, _, c) in self._pending.items() if c is cq]:
                    self._finish(wr_id, WcStatus.WR_FLUSH_ERR)
                reaped += 1
                continue
            for completion in completions:
                self._finish(completion.wr_id, completion.status)
            reaped += len(completions)
        return reaped

    def _forget_destroyed_qps(self) -> int:
        """Requests on a QP destroyed meanwhile never complete: they count as flushed (the window is unusable)."""
        gone = [wr_id for wr_id, (window, _, _) in self._pending.items() if not self.qp_alive(window.qp)]
        for wr_id in gone:
            self._finish(wr_id, WcStatus.WR_FLUSH_ERR)
        return len(gone)

    def _finish(self, wr_id: int, status: WcStatus) -> None:
        entry = self._pending.pop(wr_id, None)
        if entry is None:
            return
        window, is_bind, _ = entry
        if is_bind and status == WcStatus.SUCCESS and window.state == WindowState.BINDING:
            window.state = WindowState.BOUND
            return
        if is_bind and status != WcStatus.SUCCESS:
            logger.warning("rdma: binding memory window %#x failed: %s", window.rkey, status.name)
        self._free(window)

    def _free(self, window: NativeWindow) -> None:
        mw, window.mw = window.mw, 0
        window.state = WindowState.CLOSED
        if mw:
            _dealloc_quietly(mw)


def _dealloc_quietly(mw: int) -> None:
    try:
        _verbs.dealloc_mw(mw)
    except OSError as exc:  # still bound somewhere the device cannot reach: freed with the PD at exit
        logger.debug("rdma: dealloc_mw: %s", exc)


class _NativeBinder(WindowBinder):
    """Windows on a real device (the compiled layer's own QPs and MRs)."""

    def qp_handle(self, qp: QueuePair) -> int:
        if not isinstance(qp, NativeQP) or not qp.handle:
            raise VerbsError("the window's QP is not a live QP of the compiled layer", errno.EINVAL)
        return qp.handle

    def mr_handle(self, mr: MemoryRegion) -> int:
        if not isinstance(mr, NativeMR) or not mr.handle:
            raise VerbsError("the window's MR is not a live MR of the compiled layer", errno.EINVAL)
        return mr.handle

    def qp_cq(self, qp: QueuePair) -> CompletionQueue:
        assert isinstance(qp, NativeQP)
        return qp.cq

    def qp_depth(self, qp: QueuePair) -> int:
        assert isinstance(qp, NativeQP)
        return qp.max_send_wr


class _FakeBinder(WindowBinder):
    """Windows on the FAKE NIC through the fake provider: the bind and invalidation requests go through
    ``ibv_post_send`` into it, and the FAKE NIC (``FakeQP.run_window_request``) enforces them."""

    def __init__(self, ctx: FakeContext) -> None:
        super().__init__(_verbs.fake_alloc_pd(), ctx.name)
        self._ctx = ctx
        self._mrs: dict[int, int] = {}  # a FAKE MR's lkey -> the provider's ``struct ibv_mr`` for it
        self._posted_on: dict[int, _NativeFakePosting] = {}  # QPs with requests the FAKE NIC has not taken

    def qp_handle(self, qp: QueuePair) -> int:
        if not isinstance(qp, _NativeFakePosting) or qp.ctx is not self._ctx or not qp.native_handle:
            raise VerbsError("the window's QP belongs to another context", errno.EINVAL)
        return qp.native_handle

    def mr_handle(self, mr: MemoryRegion) -> int:
        if not isinstance(mr, FakeMR) or mr.ctx is not self._ctx or mr.bound_qp is not None:
            raise VerbsError("the window's MR belongs to another context", errno.EINVAL)
        handle = self._mrs.get(mr.lkey)
        if handle is None:
            handle = self._mrs[mr.lkey] = _verbs.fake_mr(self._pd, mr.addr, mr.length, mr.lkey, mr.rkey)
        return handle

    def qp_cq(self, qp: QueuePair) -> CompletionQueue:
        assert isinstance(qp, _NativeFakePosting)
        return qp.cq

    def qp_depth(self, qp: QueuePair) -> int:
        assert isinstance(qp, _NativeFakePosting)
        return qp.max_send_wr

    def post(self, qp: QueuePair, call: Callable[[], int | None]) -> int | None:
        assert isinstance(qp, _NativeFakePosting)
        with self._ctx.fabric.lock:
            result = call()
        self._posted_on[qp.qp_num] = qp
        return result

    def before_reap(self) -> None:
        """The FAKE NIC takes the QPs' recorded requests a batch at a time, as a NIC works through its queue."""
        posted, self._posted_on = self._posted_on, {}
        with self._ctx.fabric.lock:
            for qp in posted.values():
                if qp.native_handle:
                    qp.nic_takes()

    def close(self) -> None:
        super().close()
        with self._lock:
            handles, self._mrs = list(self._mrs.values()), {}
            pd, self._pd = self._pd, 0
        for handle in handles:
            _verbs.fake_free(handle)
        if pd:
            _verbs.fake_free(pd)


def fake_window_binder(ctx: FakeContext) -> WindowBinder:
    """The fake provider's window binder for a FAKE context (its QPs post through the compiled layer)."""
    return _FakeBinder(ctx)
