"""A thin, typed layer over the few ibverbs calls the RDMA transport needs.

Why a layer at all: pyverbs is untyped Cython, is only importable where Debian's ``python3-pyverbs`` (or an
rdma-core build) is installed, and raises from calls that "should" return empty results (on a host without a
device, ``get_device_list()`` raises ``PyverbsRDMAError`` instead of returning ``[]``). Everything above this
module - :mod:`kvpool.transfer.rdma` and its tests - talks to the abstract classes here, so that

* pyverbs is imported lazily, inside :class:`PyverbsVerbs` methods only, and never at import time of kvpool;
* mypy --strict sees typed values (ints, strs, enums, dataclasses), never pyverbs objects;
* the same transport code runs against :mod:`kvpool.transfer.verbs_fake` (an in-process simulation) in tests
  and on the team's machines, which have no RDMA device and cannot load Soft-RoCE.

The enum values are the ibverbs ABI values (``enum ibv_qp_state``, ``ibv_access_flags``, ``ibv_wc_status``,
``ibv_wr_opcode``, ``ibv_mtu``), so the real layer passes them straight through.
"""

from __future__ import annotations

import ctypes
import errno
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Any, NamedTuple

from kvpool.common.log import get_logger, log_once

logger = get_logger(__name__)

# Attributes of the RC queue pairs (the values ibv_rc_pingpong and rdma-core's tests use).
_RD_ATOMIC = 16  # outstanding RDMA READs per QP, clamped to the device's max_qp_rd_atom
_MIN_RNR_TIMER = 12
_ACK_TIMEOUT = 14  # 4.096 us * 2^14 = 67 ms per transport retry
_RETRY_CNT = 7
_RNR_RETRY = 7


# ---------------------------------------------------------------------- ABI enums
class QpState(IntEnum):
    """``enum ibv_qp_state``."""

    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    SQD = 4
    SQE = 5
    ERR = 6


# The RC state machine (IB spec vol. 1, 10.3.1, as ibv_modify_qp enforces it). A transition not listed is
# refused with EINVAL; both the fake and the pyverbs layer check it, so they fail the same way.
LEGAL_TRANSITIONS: dict[QpState, frozenset[QpState]] = {
    QpState.RESET: frozenset({QpState.RESET, QpState.INIT, QpState.ERR}),
    QpState.INIT: frozenset({QpState.RESET, QpState.INIT, QpState.RTR, QpState.ERR}),
    QpState.RTR: frozenset({QpState.RESET, QpState.RTS, QpState.ERR}),
    QpState.RTS: frozenset({QpState.RESET, QpState.RTS, QpState.SQD, QpState.ERR}),
    QpState.SQD: frozenset({QpState.RESET, QpState.RTS, QpState.SQD, QpState.ERR}),
    QpState.SQE: frozenset({QpState.RESET, QpState.RTS, QpState.ERR}),
    QpState.ERR: frozenset({QpState.RESET, QpState.ERR}),
}


class Access(IntFlag):
    """``enum ibv_access_flags`` (the subset kvpool uses)."""

    NONE = 0
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    MW_BIND = 16
    """An MR that memory windows may be bound to (type-2 windows per grant, decision 0020)."""


class Opcode(IntEnum):
    """``enum ibv_wr_opcode`` (one-sided operations only)."""

    RDMA_WRITE = 0
    RDMA_READ = 4


class WcStatus(IntEnum):
    """``enum ibv_wc_status``."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21

    @classmethod
    def of(cls, value: int) -> WcStatus:
        """Unknown (newer, vendor) statuses are a general error, never an exception while polling."""
        try:
            return cls(value)
        except ValueError:
            return cls.GENERAL_ERR


class Mtu(IntEnum):
    """``enum ibv_mtu``: the path MTU is the smaller of the two ports' active MTUs."""

    MTU_256 = 1
    MTU_512 = 2
    MTU_1024 = 3
    MTU_2048 = 4
    MTU_4096 = 5

    @classmethod
    def of(cls, value: int) -> Mtu:
        return cls(min(max(int(value), cls.MTU_256), cls.MTU_4096))


# ---------------------------------------------------------------------- values
class VerbsError(Exception):
    """A verbs call failed; ``errno`` is the OS error code when the library reported one (else 0)."""

    def __init__(self, message: str, err: int = 0) -> None:
        super().__init__(message)
        self.errno = err


@dataclass(frozen=True, slots=True)
class PortInfo:
    """What a peer needs to address this port: LID (InfiniBand) or GID (RoCE), and the active MTU."""

    lid: int
    gid: str
    mtu: Mtu


@dataclass(frozen=True, slots=True)
class QpInfo:
    """One side of an RC connection, as exchanged over the TCP control channel."""

    qp_num: int
    lid: int
    gid: str
    psn: int
    mtu: Mtu


class WorkRequest(NamedTuple):
    """One signaled one-sided RDMA READ or WRITE of ``length`` bytes between a local and a remote MR (a tuple:
    the client builds one per work request on its posting path, decision 0021)."""

    wr_id: int
    opcode: Opcode
    local_addr: int
    length: int
    lkey: int
    remote_addr: int
    rkey: int


@dataclass(frozen=True, slots=True)
class Completion:
    """One polled work completion."""

    wr_id: int
    status: WcStatus
    byte_len: int = 0
    vendor_err: int = 0


ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def check_transition(current: QpState, target: QpState) -> None:
    """Refuse a QP transition that ibv_modify_qp would refuse (EINVAL)."""
    if target not in LEGAL_TRANSITIONS[current]:
        raise VerbsError(f"illegal QP transition {current.name} -> {target.name}", errno.EINVAL)


# ---------------------------------------------------------------------- the interface
class MemoryRegion(ABC):
    """A registered (pinned) range of local memory: ``lkey`` for local SGEs, ``rkey`` for peers."""

    addr: int
    length: int
    lkey: int
    rkey: int

    @abstractmethod
    def close(self) -> None:
        """Deregister; safe to call twice."""


class CompletionQueue(ABC):
    @abstractmethod
    def poll(self, max_entries: int) -> list[Completion]:
        """Up to ``max_entries`` completions, without blocking."""

    @abstractmethod
    def close(self) -> None: ...


class QueuePair(ABC):
    """A reliable-connected QP. Transitions are explicit (no implicit RESET->INIT inside to_rtr)."""

    @property
    @abstractmethod
    def qp_num(self) -> int: ...

    @property
    @abstractmethod
    def state(self) -> QpState: ...

    @abstractmethod
    def to_init(self, access: Access) -> None:
        """RESET -> INIT; ``access`` is what *incoming* requests may do on this QP."""

    @abstractmethod
    def to_rtr(self, remote: QpInfo, mtu: Mtu) -> None:
        """INIT -> RTR: connect to ``remote``."""

    @abstractmethod
    def to_rts(self, psn: int) -> None:
        """RTR -> RTS with our send PSN."""

    @abstractmethod
    def to_error(self) -> None:
        """Any -> ERR: outstanding work requests complete with WR_FLUSH_ERR, the NIC stops touching memory."""

    @abstractmethod
    def post_send(self, wr: WorkRequest) -> None:
        """Post one signaled one-sided work request (it produces exactly one completion).

        One at a time, so that a refused post (a full send queue) leaves no doubt about what was posted.
        """

    def post_send_list(self, wrs: Sequence[WorkRequest]) -> int:
        """Post several work requests in order, as one chained list where the library allows it (decision
        0021). Returns how many were posted: all of them, or - when one was refused - those before it, the
        refusal being :attr:`last_post_error`. A refused WR and those after it were not posted."""
        self.last_post_error = None
        for posted, wr in enumerate(wrs):
            try:
                self.post_send(wr)
            except VerbsError as exc:
                self.last_post_error = exc
                return posted
        return len(wrs)

    last_post_error: VerbsError | None = None
    """Why the last :meth:`post_send_list` stopped short (None: it posted everything)."""

    def post_chunks(
        self, chunks: list[Any], start: int, stop: int, first_wr_id: int, now_ms: int
    ) -> tuple[int, VerbsError | None, bool]:
        """Post ``chunks[start:stop]`` as one list with wr_ids ``first_wr_id``, ``first_wr_id + 1``, ...: the
        client's posting entry point (decision 0027). A chunk has ``opcode``, ``expiry_ms`` (its grant's end,
        wall ms; 0: none) and ``piece`` (``local_addr``, ``length``, ``lkey``, ``remote_addr``, ``rkey``).

        Returns (posted, refusal, expired): posting stops before a chunk whose grant expired
        (``0 < expiry_ms <= now_ms``; ``expired`` is then True and that chunk is ``chunks[start + posted]``,
        not posted) and where the device refused one (``refusal``). The compiled layer
        (:mod:`kvpool.transfer.verbs_native`) builds the list in C; this is the Python fallback."""
        wrs: list[WorkRequest] = []
        expired = False
        for chunk in chunks[start:stop]:
            if chunk.expiry_ms and chunk.expiry_ms <= now_ms:
                expired = True
                break
            p = chunk.piece
            wr = WorkRequest(
                first_wr_id + len(wrs), chunk.opcode, p.local_addr, p.length, p.lkey, p.remote_addr, p.rkey
            )
            wrs.append(wr)
        posted = self.post_send_list(wrs) if wrs else 0
        refusal = None
        if posted < len(wrs):
            refusal = self.last_post_error or VerbsError(f"posted {posted} of {len(wrs)} work requests", errno.EIO)
        return posted, refusal, expired and refusal is None

    @abstractmethod
    def close(self) -> None: ...


class DeviceContext(ABC):
    """An opened device port with its protection domain."""

    name: str
    port: int
    gid_index: int

    @property
    @abstractmethod
    def max_mr_bytes(self) -> int:
        """The largest single MR the device registers (``max_mr_size``)."""

    @property
    def max_qp_wr(self) -> int:
        """The deepest send queue the device allows."""
        return 16384

    @abstractmethod
    def port_info(self) -> PortInfo: ...

    @abstractmethod
    def reg_mr(self, address: int, length: int, access: Access) -> MemoryRegion: ...

    @abstractmethod
    def create_cq(self, depth: int) -> CompletionQueue: ...

    def reg_dmabuf_mr(self, fd: int, offset: int, length: int, iova: int, access: Access) -> MemoryRegion:
        """Register ``length`` bytes of a dma-buf (GPU memory its driver exported, decision 0023) from
        ``offset``. The MR's addresses are IOVAs, not virtual addresses: its ``addr`` is ``iova`` and an SGE
        names byte k of it as ``iova + k``. The fd may be closed once this returns (the MR holds the dma-buf)."""
        raise VerbsError(f"{self.name}: dma-buf memory regions are not supported by this verbs layer", errno.EOPNOTSUPP)

    @property
    def supports_windows(self) -> bool:
        """Whether :meth:`bind_window` works here (type-2 memory windows)."""
        return False

    def bind_window(self, mr: MemoryRegion, qp: QueuePair, addr: int, length: int, access: Access) -> MemoryRegion:
        """A type-2 memory window over [addr, addr+length) of ``mr``, usable only through ``qp`` with
        ``access``: its ``rkey`` reaches that range alone, and ``close()`` invalidates it at once."""
        raise VerbsError(f"{self.name}: memory windows are not supported by this verbs layer", errno.EOPNOTSUPP)

    def flush_windows(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Make the window binds and invalidations before this call take effect (a batch of them at once)."""

    @abstractmethod
    def create_qp(self, cq: CompletionQueue, max_send_wr: int) -> QueuePair: ...

    @abstractmethod
    def close(self) -> None: ...


class Verbs(ABC):
    """A verbs implementation: the real one (:class:`PyverbsVerbs`) or the fake (verbs_fake.FakeVerbs)."""

    name: str = "abstract"

    @abstractmethod
    def list_devices(self) -> list[str]:
        """Device names; raises whatever the library raises (see :func:`discover_devices`)."""

    @abstractmethod
    def open(self, device: str, port: int = 1, gid_index: int = 0) -> DeviceContext: ...

    def numa_node(self, device: str) -> int:
        """The NUMA node a device sits on (sysfs ``device/numa_node``); -1 when unknown."""
        try:
            with open(f"/sys/class/infiniband/{device}/device/numa_node", encoding="ascii") as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return -1


# ---------------------------------------------------------------------- discovery
NO_RDMA_LOG_KEY = "kvpool.rdma.unavailable"


def discover_devices(verbs: Verbs | None = None) -> list[str]:
    """RDMA device names, or ``[]`` - and then one log line per process saying TCP will be used.

    A missing pyverbs (ImportError), a library that raises (Debian's pyverbs raises PyverbsRDMAError when the
    kernel has no RDMA support) and an empty device list all mean the same thing to the caller: no RDMA here,
    use TCP. That is logged once, not per client or per store, because it is a property of the host.
    """
    try:
        names = (verbs if verbs is not None else PyverbsVerbs()).list_devices()
    except ImportError as exc:
        _no_rdma(f"pyverbs is not installed ({exc})")
        return []
    except Exception as exc:  # PyverbsRDMAError and whatever else the library raises: all mean "no RDMA"
        _no_rdma(f"listing devices failed: {type(exc).__name__}: {exc}")
        return []
    if not names:
        _no_rdma("no RDMA device found")
        return []
    return names


def _no_rdma(reason: str) -> None:
    log_once(logger, logging.INFO, NO_RDMA_LOG_KEY, "RDMA unavailable (%s): using TCP", reason)


# ---------------------------------------------------------------------- buffers
def buffer_address(view: memoryview) -> int:
    """The address of a C-contiguous buffer's first byte (for MR registration and SGEs).

    Writable buffers go through ctypes; read-only ones (a ``bytes`` value being written) through numpy,
    since ctypes refuses them. The temporary export is dropped before returning, so the caller's
    memoryview can still be released afterwards.
    """
    if not view.c_contiguous:
        raise ValueError("RDMA needs a C-contiguous buffer")
    if view.nbytes == 0:
        return 0
    flat = view if view.format == "B" and view.ndim == 1 else view.cast("B")
    if not flat.readonly:
        anchor = ctypes.c_char.from_buffer(flat)
        address = ctypes.addressof(anchor)
        del anchor
        return address
    import numpy as np

    array = np.frombuffer(flat, dtype=np.uint8)
    address = int(array.ctypes.data)
    del array
    return address


# ---------------------------------------------------------------------- the real layer (pyverbs)
def _wrap(what: str, exc: Exception) -> VerbsError:
    code = getattr(exc, "error_code", 0)
    err = code if isinstance(code, int) and code > 0 else 0
    return VerbsError(f"{what}: {type(exc).__name__}: {exc}", err)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


class PyverbsVerbs(Verbs):
    """The real verbs, through pyverbs (Debian's ``python3-pyverbs``), imported on first use."""

    name = "pyverbs"

    def list_devices(self) -> list[str]:
        from pyverbs.device import get_device_list

        return [_str(dev.name) for dev in get_device_list()]

    def open(self, device: str, port: int = 1, gid_index: int = 0) -> DeviceContext:
        return _PvContext(device, port, gid_index)


class _PvContext(DeviceContext):
    def __init__(self, device: str, port: int, gid_index: int) -> None:
        try:
            from pyverbs.device import Context
            from pyverbs.pd import PD

            self._ctx: Any = Context(name=device)
            self._pd: Any = PD(self._ctx)
            attr = self._ctx.query_device()
            self._max_mr = int(attr.max_mr_size)
            self._max_qp_wr = int(attr.max_qp_wr)
            self.max_rd_atomic = max(1, min(_RD_ATOMIC, int(attr.max_qp_rd_atom)))
        except ImportError:
            raise
        except Exception as exc:
            raise _wrap(f"open RDMA device {device}", exc) from exc
        self.name = device
        self.port = port
        self.gid_index = gid_index

    @property
    def max_mr_bytes(self) -> int:
        return self._max_mr

    @property
    def max_qp_wr(self) -> int:
        return self._max_qp_wr

    def port_info(self) -> PortInfo:
        try:
            attr = self._ctx.query_port(self.port)
            gid = _str(self._ctx.query_gid(self.port, self.gid_index).gid)
            return PortInfo(lid=int(attr.lid), gid=gid, mtu=Mtu.of(int(attr.active_mtu)))
        except Exception as exc:
            raise _wrap(f"query port {self.name}:{self.port}", exc) from exc

    def reg_mr(self, address: int, length: int, access: Access) -> MemoryRegion:
        try:
            from pyverbs.mr import MR

            return _PvMR(MR(self._pd, length, int(access), address=address), address, length)
        except Exception as exc:
            raise _wrap(f"register {length} bytes at {address:#x}", exc) from exc

    def reg_dmabuf_mr(self, fd: int, offset: int, length: int, iova: int, access: Access) -> MemoryRegion:
        # pyverbs' DmaBufMR(pd, length, access, dmabuf=fd, offset=offset) calls ibv_reg_dmabuf_mr with
        # iova = offset: another IOVA cannot be asked for through it.
        if iova != offset:
            raise VerbsError(f"pyverbs registers a dma-buf MR at iova == offset ({offset}), not {iova}", errno.EINVAL)
        try:
            from pyverbs.mr import DmaBufMR

            return _PvMR(DmaBufMR(self._pd, length, int(access), dmabuf=fd, offset=offset), iova, length)
        except Exception as exc:
            raise _wrap(f"register {length} bytes of dma-buf fd {fd} at offset {offset}", exc) from exc

    def create_cq(self, depth: int) -> CompletionQueue:
        try:
            from pyverbs.cq import CQ

            return _PvCQ(CQ(self._ctx, depth, None, None, 0))
        except Exception as exc:
            raise _wrap(f"create a CQ of depth {depth}", exc) from exc

    def create_qp(self, cq: CompletionQueue, max_send_wr: int) -> QueuePair:
        if not isinstance(cq, _PvCQ):
            raise VerbsError("the CQ belongs to another verbs layer", errno.EINVAL)
        try:
            from pyverbs.qp import QP

            return _PvQP(QP(self._pd, pv_qp_init_attr(cq.cq, max_send_wr)), self)
        except Exception as exc:
            raise _wrap("create an RC QP", exc) from exc

    def close(self) -> None:
        for obj in (self._pd, self._ctx):
            try:
                obj.close()
            except Exception as exc:  # closing twice or after a device reset: nothing left to free
                logger.debug("closing %s: %s", type(obj).__name__, exc)


class _PvMR(MemoryRegion):
    def __init__(self, mr: Any, address: int, length: int) -> None:
        self._mr = mr
        self.addr = address
        self.length = length
        self.lkey = int(mr.lkey)
        self.rkey = int(mr.rkey)

    def close(self) -> None:
        try:
            self._mr.close()
        except Exception as exc:
            raise _wrap("deregister MR", exc) from exc


class _PvCQ(CompletionQueue):
    def __init__(self, cq: Any) -> None:
        self.cq = cq

    def poll(self, max_entries: int) -> list[Completion]:
        try:
            count, wcs = self.cq.poll(max_entries)
        except Exception as exc:
            raise _wrap("poll CQ", exc) from exc
        return [
            Completion(int(wc.wr_id), WcStatus.of(int(wc.status)), int(wc.byte_len), int(wc.vendor_err))
            for wc in list(wcs)[:count]
        ]

    def close(self) -> None:
        try:
            self.cq.close()
        except Exception as exc:
            logger.debug("closing CQ: %s", exc)


class _PvQP(QueuePair):
    def __init__(self, qp: Any, ctx: _PvContext) -> None:
        self._qp = qp
        self._ctx = ctx
        self._state = QpState.RESET
        self._num = int(qp.qp_num)
        self._chain = PvSendChain()

    @property
    def qp_num(self) -> int:
        return self._num

    @property
    def state(self) -> QpState:
        return self._state

    def to_init(self, access: Access) -> None:
        check_transition(self._state, QpState.INIT)
        self._modify("to_init", pv_init_attr(self._ctx.port, access), QpState.INIT)

    def to_rtr(self, remote: QpInfo, mtu: Mtu) -> None:
        check_transition(self._state, QpState.RTR)
        attr = pv_rtr_attr(self._ctx.port, self._ctx.gid_index, self._ctx.max_rd_atomic, remote, mtu)
        self._modify("to_rtr", attr, QpState.RTR)

    def to_rts(self, psn: int) -> None:
        check_transition(self._state, QpState.RTS)
        self._modify("to_rts", pv_rts_attr(self._ctx.port, psn, self._ctx.max_rd_atomic), QpState.RTS)

    def to_error(self) -> None:
        try:
            attr, mask = pv_error_attr()
            self._qp.modify(attr, mask)
        except Exception as exc:
            raise _wrap("QP -> ERR", exc) from exc
        self._state = QpState.ERR

    def _modify(self, method: str, attr: Any, target: QpState) -> None:
        try:
            getattr(self._qp, method)(attr)
        except Exception as exc:
            raise _wrap(f"QP {self._num} {method}", exc) from exc
        self._state = target

    def post_send(self, wr: WorkRequest) -> None:
        try:
            self._qp.post_send(pv_send_wr(wr))
        except Exception as exc:
            raise _wrap(f"post_send on QP {self._num}", exc) from exc

    def post_send_list(self, wrs: Sequence[WorkRequest]) -> int:
        """One ``ibv_post_send`` for the whole list, chained through ``next_wr`` with reused SendWR/SGE
        objects; ``bad_wr`` says where the device stopped (the ones before it were posted)."""
        self.last_post_error = None
        if not wrs:
            return 0
        head = self._chain.build(wrs)
        bad = pv_send_wr(wrs[0])  # where the device stopped: pyverbs copies the refused WR into it
        bad.wr_id = _NO_WR
        try:
            self._qp.post_send(head, bad)
        except Exception as exc:
            self.last_post_error = _wrap(f"post_send of {len(wrs)} on QP {self._num}", exc)
            # Where the device stopped is unknown: count every WR as posted, so that the caller waits for
            # their completions (or flushes) before it lets go of the buffers.
            return next((n for n, wr in enumerate(wrs) if wr.wr_id == bad.wr_id), len(wrs))
        return len(wrs)

    def close(self) -> None:
        try:
            self._qp.close()
        except Exception as exc:
            logger.debug("closing QP %d: %s", self._num, exc)


# ---------------------------------------------------------------------- pyverbs attribute builders
# Module-level so that a test can build each of them with the real pyverbs on a host without a device
# (tests/integration/test_rdma_fallback.py): the structs need no device, so a wrong keyword or attribute
# name is caught on every run, not only on an RDMA cluster.
def pv_qp_init_attr(cq: Any, max_send_wr: int) -> Any:
    """An RC QP whose every send WR is signaled, with a minimal receive queue (one-sided ops only)."""
    import pyverbs.enums as e
    from pyverbs.qp import QPCap, QPInitAttr

    cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    return QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1)


def pv_init_attr(port: int, access: Access) -> Any:
    """RESET -> INIT: port, P_Key index 0, and what incoming requests may do."""
    from pyverbs.qp import QPAttr

    attr = QPAttr(port_num=port)
    attr.qp_access_flags = int(access)
    attr.pkey_index = 0
    return attr


def pv_rtr_attr(port: int, gid_index: int, rd_atomic: int, remote: QpInfo, mtu: Mtu) -> Any:
    """INIT -> RTR: the peer's QP number, PSN and address (GID with a GRH for RoCE, else its LID)."""
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr

    attr = QPAttr(port_num=port)
    attr.path_mtu = int(mtu)
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn  # the first PSN the peer will send us
    attr.max_dest_rd_atomic = rd_atomic
    attr.min_rnr_timer = _MIN_RNR_TIMER
    if remote.gid and remote.gid != ZERO_GID:  # RoCE (and routed IB): address by GID, with a GRH
        route = GlobalRoute(dgid=GID(remote.gid), sgid_index=gid_index)
        attr.ah_attr = AHAttr(port_num=port, is_global=1, gr=route, dlid=remote.lid)
    else:  # InfiniBand within one subnet: the LID is enough
        attr.ah_attr = AHAttr(port_num=port, is_global=0, dlid=remote.lid)
    return attr


def pv_rts_attr(port: int, psn: int, rd_atomic: int) -> Any:
    """RTR -> RTS: our send PSN, the ack timeout and retry counts, outstanding RDMA READs."""
    from pyverbs.qp import QPAttr

    attr = QPAttr(port_num=port)
    attr.sq_psn = psn
    attr.timeout = _ACK_TIMEOUT
    attr.retry_cnt = _RETRY_CNT
    attr.rnr_retry = _RNR_RETRY
    attr.max_rd_atomic = rd_atomic
    return attr


def pv_error_attr() -> tuple[Any, int]:
    """Any -> ERR: the attribute and the mask for ``QP.modify``."""
    import pyverbs.enums as e
    from pyverbs.qp import QPAttr

    return QPAttr(qp_state=e.IBV_QPS_ERR), int(e.IBV_QP_STATE)


_NO_WR = (1 << 64) - 1


class PvSendChain:
    """Reusable pyverbs SendWR/SGE objects (decision 0021): building a SendWR costs several times what
    refilling its fields does. pyverbs cannot unlink ``next_wr`` once set, so the links are made once, over a
    ring of ``capacity`` objects each pointing to the next, and a list of n requests fills the *last* n
    objects and posts from the first of them; the last object ends every chain."""

    def __init__(self) -> None:
        self._wrs: list[Any] = []
        self._sges: list[Any] = []

    @property
    def capacity(self) -> int:
        return len(self._wrs)

    def build(self, wrs: Sequence[WorkRequest]) -> Any:
        """The head of a chain carrying ``wrs`` in order."""
        if len(wrs) > len(self._wrs):
            self._grow(len(wrs), wrs[0])
        start = len(self._wrs) - len(wrs)
        for n, wr in enumerate(wrs):
            send, sge = self._wrs[start + n], self._sges[start + n]
            send.wr_id = wr.wr_id
            send.opcode = int(wr.opcode)
            send.set_wr_rdma(wr.rkey, wr.remote_addr)
            sge.addr, sge.length, sge.lkey = wr.local_addr, wr.length, wr.lkey
            send.sg_list = sge
        return self._wrs[start]

    def _grow(self, capacity: int, template: WorkRequest) -> None:
        self._wrs = [pv_send_wr(template) for _ in range(capacity)]
        self._sges = [_pv_sge(template) for _ in range(capacity)]
        for send, following in zip(self._wrs, self._wrs[1:], strict=False):
            send.next_wr = following


def _pv_sge(wr: WorkRequest) -> Any:
    from pyverbs.wr import SGE

    return SGE(wr.local_addr, wr.length, wr.lkey)


def pv_send_wr(wr: WorkRequest) -> Any:
    """A signaled one-sided work request with one SGE."""
    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR

    sge = SGE(wr.local_addr, wr.length, wr.lkey)
    send = SendWR(wr_id=wr.wr_id, opcode=int(wr.opcode), num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
    send.set_wr_rdma(wr.rkey, wr.remote_addr)
    return send
