"""The RDMA transport: one-sided RDMA READ/WRITE over reliable-connected queue pairs (DESIGN §6).

Shape:

* **Verbs behind a layer.** Everything goes through :mod:`kvpool.transfer.verbs` (typed, pyverbs imported
  lazily) so that the same code runs against :mod:`kvpool.transfer.verbs_fake` in tests. Where pyverbs or a
  device is missing, :func:`kvpool.transfer.factory.make_transports` simply leaves RDMA out (one log line).
* **Connection setup over the store's TCP control channel.** The client creates an RC QP, sends its QP info
  (qp_num, LID/GID, PSN, MTU) in an ``RDMA_CONNECT`` frame (JSON payload) to the store's data-plane port, and
  gets back the store's QP info plus the segment's memory regions (base address, length, rkey). The store
  side is :class:`RdmaResponder`, which the data plane calls with the request payload. The TCP connection
  stays open for the QP's lifetime: when it closes, the store releases the QP (so a crashed client leaks
  nothing), and a client that sees it closed reconnects.
* **Authorisation happens at connect time.** With one-sided RDMA the store CPU never sees a request, so the
  per-request grant check of the TCP path cannot happen. Instead ``RDMA_CONNECT`` carries master-signed grants
  (one per segment wanted; the client uses the grant of its first request there), verified with the
  segment's secret - or it arrives on a connection that presented the cluster token (HELLO). A READ-only grant
  gets a QP that refuses remote writes (the QP's access flags, enforced by the NIC). After that the client
  can touch any byte of the segments it was admitted to, until the connection closes: the trust boundary is
  "a client the master admitted", not "this range until then". docs/rdma.md spells the trade-off out.
* **Chunking.** A client buffer is registered as MRs of at most ``max_mr_bytes`` (NICs cap one MR; Mooncake
  issue #640), the store registers its segment the same way, and each request is cut at every local and
  remote MR boundary and at ``max_wr_bytes``: a request larger than one chunk becomes several work requests.
* **Completions.** Every work request is signaled; a batch posts up to the send-queue depth and polls the
  CQ (any thread waiting on any batch makes progress for all batches on that connection). An error
  completion (or a refused post) moves the QP to ERR: the remaining work requests flush, the requests get
  TRANSFER_FAILED (TIMEOUT for the retry/ack timeouts), and the QP is torn down and re-established on next
  use. A deadline that passes with work in flight aborts the QP (ERR, flush, destroy) so that the NIC can
  no longer touch the caller's buffers, and the requests get TIMEOUT.
* **Reachability.** :meth:`RdmaTransport.can_reach` is true only for replicas whose store advertised RDMA
  (``STORE_INFO``'s ``"rdma"`` entry, fed in with :meth:`RdmaTransport.note_store_info`), and not while the
  store is in a reconnect cooldown, so :class:`~kvpool.transfer.registry.TransportSet` sends the rest over
  TCP.
"""

from __future__ import annotations

import bisect
import json
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpool.common.clock import SYSTEM_CLOCK, Clock, Deadline
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.grants import Grant, GrantOp, verify
from kvpool.common.log import get_logger
from kvpool.proto import frames
from kvpool.proto.frames import MAX_KEY_BYTES, Op
from kvpool.transfer.base import Replica, TransferBatch, TransferRequest, Transport
from kvpool.transfer.verbs import (
    Access,
    CompletionQueue,
    DeviceContext,
    MemoryRegion,
    Mtu,
    Opcode,
    QpInfo,
    QueuePair,
    Verbs,
    VerbsError,
    WcStatus,
    WorkRequest,
    buffer_address,
)

logger = get_logger(__name__)

PROTOCOL_VERSION = 1
MAX_CONNECT_PAYLOAD = 64 * 1024
"""Largest RDMA_CONNECT request or reply (JSON); a data plane may refuse bigger frames as BAD_FRAME."""
DEFAULT_MAX_WR_BYTES = 1 << 30
DEFAULT_SQ_DEPTH = 128
_POLL_BATCH = 64
_ABORT_DRAIN_S = 1.0  # how long an aborted QP may take to flush before it is destroyed regardless
_FAILURES_BEFORE_COOLDOWN = 3

# Connect refusals about the request's grants, not about the path to the store: no cooldown for these.
_REQUEST_REFUSALS = frozenset({ErrorCode.AUTH_FAILED, ErrorCode.GRANT_EXPIRED, ErrorCode.SEGMENT_NOT_FOUND})
_TIMEOUT_STATUSES = frozenset({WcStatus.RETRY_EXC_ERR, WcStatus.RNR_RETRY_EXC_ERR, WcStatus.RESP_TIMEOUT_ERR})


def completion_code(status: WcStatus) -> ErrorCode:
    """The ErrorCode a request gets for a work completion status.

    The transport retry/ack timeouts (the peer stopped answering) are TIMEOUT; every other failure -
    protection and access errors, flushes after an earlier error, fatal device errors - is TRANSFER_FAILED.
    """
    if status == WcStatus.SUCCESS:
        return ErrorCode.OK
    if status in _TIMEOUT_STATUSES:
        return ErrorCode.TIMEOUT
    return ErrorCode.TRANSFER_FAILED


# ---------------------------------------------------------------------- wire format of RDMA_CONNECT
@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """One registered MR of a store segment: segment bytes [offset, offset+length) live at ``addr``."""

    segment_id: int
    offset: int
    length: int
    addr: int
    rkey: int

    def to_json(self) -> dict[str, int]:
        return {
            "segment_id": self.segment_id,
            "offset": self.offset,
            "length": self.length,
            "addr": self.addr,
            "rkey": self.rkey,
        }

    @classmethod
    def from_json(cls, doc: Any) -> RemoteRegion:
        d = _obj(doc, "region")
        return cls(
            _int(d, "segment_id"),
            _int(d, "offset"),
            _int(d, "length", 1),
            _int(d, "addr", 1),
            _int(d, "rkey", 0, 0xFFFFFFFF),
        )


def qp_info_to_json(info: QpInfo) -> dict[str, Any]:
    return {"qp_num": info.qp_num, "lid": info.lid, "gid": info.gid, "psn": info.psn, "mtu": int(info.mtu)}


def qp_info_from_json(doc: Any) -> QpInfo:
    d = _obj(doc, "qp")
    gid = d.get("gid")
    if not isinstance(gid, str) or len(gid) > 64:
        raise KvPoolError(ErrorCode.BAD_FRAME, "RDMA_CONNECT: bad gid")
    return QpInfo(
        qp_num=_int(d, "qp_num", 1, 0xFFFFFF),
        lid=_int(d, "lid", 0, 0xFFFF),
        gid=gid,
        psn=_int(d, "psn", 0, 0xFFFFFF),
        mtu=Mtu(_int(d, "mtu", Mtu.MTU_256, Mtu.MTU_4096)),
    )


def grant_to_json(grant: Grant) -> dict[str, Any]:
    return {
        "op": int(grant.op),
        "segment_id": grant.segment_id,
        "offset": grant.offset,
        "length": grant.length,
        "expiry_ms": grant.expiry_ms,
        "key": grant.key.hex(),
        "mac": grant.mac.hex(),
    }


def grant_from_json(doc: Any) -> Grant:
    d = _obj(doc, "grant")
    try:
        op = GrantOp(_int(d, "op", 1, 2))
        key, mac = bytes.fromhex(str(d.get("key", ""))), bytes.fromhex(str(d.get("mac", "")))
    except ValueError as exc:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"RDMA_CONNECT: bad grant: {exc}") from None
    if len(key) > MAX_KEY_BYTES:
        raise KvPoolError(ErrorCode.BAD_FRAME, "RDMA_CONNECT: grant key too long")
    return Grant(op, _int(d, "segment_id"), _int(d, "offset"), _int(d, "length"), _int(d, "expiry_ms"), key, mac)


def _obj(doc: Any, what: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise KvPoolError(ErrorCode.BAD_FRAME, f"RDMA_CONNECT: {what} is not an object")
    return doc


def _int(d: dict[str, Any], name: str, lo: int = 0, hi: int = (1 << 64) - 1) -> int:
    value = d.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"RDMA_CONNECT: field {name!r} must be an integer in [{lo}, {hi}]")
    return value


def _decode(payload: bytes | bytearray | memoryview, what: str) -> dict[str, Any]:
    if len(payload) > MAX_CONNECT_PAYLOAD:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"{what} of {len(payload)} bytes")
    try:
        doc = json.loads(bytes(payload))
    except ValueError:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"{what} is not JSON") from None
    d = _obj(doc, what)
    if d.get("v") != PROTOCOL_VERSION:
        raise KvPoolError(
            ErrorCode.NOT_SUPPORTED,
            f"{what}: protocol version {d.get('v')!r}, this side speaks {PROTOCOL_VERSION}",
        )
    return d


def _encode(doc: dict[str, Any]) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, **doc}, separators=(",", ":")).encode()


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
    view: memoryview
    refs: int = 1

    def close(self) -> None:
        for mr in self.mrs:
            _close_quietly(mr)
        self.mrs = []

    def spans(self) -> list[tuple[int, int, int]]:
        return [(mr.addr, mr.length, mr.lkey) for mr in self.mrs]


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
    local_spans: Sequence[tuple[int, int, int]],
    remote_offset: int,
    regions: Sequence[RemoteRegion],
    length: int,
    max_chunk: int,
) -> list[Piece]:
    """Cut a transfer of ``length`` bytes at every local MR boundary, remote MR boundary and ``max_chunk``.

    ``local_spans`` are the (addr, length, lkey) of the MRs holding the local range, ``regions`` the MRs of
    the remote segment. Raises KvPoolError(OUT_OF_BOUNDS) when a byte is in no remote region and
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
        pieces.append(Piece(pos, n, la, span[2], region.addr + (ro - region.offset), region.rkey))
        pos += n
    return pieces


# ---------------------------------------------------------------------- batches and chunks
@dataclass(eq=False, slots=True)
class _Chunk:
    batch: _Batch
    conn: _Connection
    index: int
    opcode: Opcode
    piece: Piece


class _Batch(TransferBatch):
    """Per-request codes; a request is OK only when every one of its work requests completed OK."""

    def __init__(self, n_requests: int, deadline: Deadline, poll_interval_s: float) -> None:
        self.codes: list[ErrorCode] = [ErrorCode.OK] * n_requests
        self.deadline = deadline
        self._poll_max = poll_interval_s
        self._lock = threading.Lock()
        self._outstanding = 0
        self._per_request = [0] * n_requests  # work requests not yet completed, per request
        self._per_conn: dict[_Connection, int] = {}  # ... and per connection
        self.connections: list[_Connection] = []
        self.temporary: list[_Registration] = []
        self._finished = False

    def fail(self, index: int, code: ErrorCode) -> None:
        with self._lock:
            if self.codes[index] == ErrorCode.OK:
                self.codes[index] = code

    def add_chunks(self, chunks: Sequence[_Chunk]) -> None:
        with self._lock:
            self._outstanding += len(chunks)
            for chunk in chunks:
                self._per_request[chunk.index] += 1
                self._per_conn[chunk.conn] = self._per_conn.get(chunk.conn, 0) + 1
                if chunk.conn not in self.connections:
                    self.connections.append(chunk.conn)

    def finish(self, chunk: _Chunk, code: ErrorCode) -> None:
        with self._lock:
            if code != ErrorCode.OK and self.codes[chunk.index] == ErrorCode.OK:
                self.codes[chunk.index] = code
            self._outstanding -= 1
            self._per_request[chunk.index] -= 1
            self._per_conn[chunk.conn] -= 1

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def wait(self, deadline: Deadline) -> list[ErrorCode]:
        if not self._finished:
            self._drive(deadline)
            for reg in self.temporary:
                reg.close()
            self.temporary = []
            self._finished = True
        return list(self.codes)

    def _drive(self, deadline: Deadline) -> None:
        """Make progress on every connection this batch uses until its work is done or a deadline passes."""
        sleep = 0.0
        while True:
            for conn in self.connections:
                conn.progress()
            if self._outstanding == 0:
                return
            if deadline.expired() or self.deadline.expired():
                self._abort()
                return
            if sleep:
                time.sleep(sleep)
            sleep = min(self._poll_max, sleep * 2 or 20e-6)

    def _abort(self) -> None:
        """Abort the connections that still hold work of this batch (only those: others keep theirs)."""
        with self._lock:
            busy = [conn for conn, n in self._per_conn.items() if n > 0]
        for conn in busy:
            conn.abort(ErrorCode.TIMEOUT, "deadline passed with work requests in flight")
        with self._lock:  # belt and braces: a request with work unaccounted for is not reported OK
            for index, left in enumerate(self._per_request):
                if left > 0 and self.codes[index] == ErrorCode.OK:
                    self.codes[index] = ErrorCode.TIMEOUT


# ---------------------------------------------------------------------- connections
class _Connection:
    """One RC QP to one store, its CQ, the control socket that keeps it alive, and its work queues."""

    def __init__(
        self,
        endpoint: str,
        sock: socket.socket,
        qp: QueuePair,
        cq: CompletionQueue,
        regions: list[RemoteRegion],
        writable: bool,
        depth: int,
    ) -> None:
        self.endpoint = endpoint
        self.writable = writable
        self._sock: socket.socket | None = sock
        self._qp: QueuePair | None = qp
        self._cq: CompletionQueue | None = cq
        self._regions: dict[int, list[RemoteRegion]] = {}
        for region in regions:
            self._regions.setdefault(region.segment_id, []).append(region)
        self._depth = depth
        self._lock = threading.Lock()
        self._pending: deque[_Chunk] = deque()
        self._inflight: dict[int, _Chunk] = {}
        self._next_wr = 0
        self.broken: ErrorCode | None = None
        self.retired = False
        self.work_requests = 0
        self.successes = 0

    # ---- queries
    def covers(self, segment_ids: Iterable[int]) -> bool:
        return all(s in self._regions for s in segment_ids)

    def regions(self, segment_id: int) -> list[RemoteRegion]:
        return self._regions.get(segment_id, [])

    @property
    def usable(self) -> bool:
        return self.broken is None and not self.retired and not self._peer_closed()

    def _peer_closed(self) -> bool:
        """The store closed the control connection (restart, release): its QP is gone too."""
        sock = self._sock
        if sock is None:
            return True
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    # ---- work
    def enqueue(self, chunks: Sequence[_Chunk]) -> None:
        with self._lock:
            if self.broken is not None or self._qp is None:
                for chunk in chunks:
                    chunk.batch.finish(chunk, self.broken or ErrorCode.CONNECTION_FAILED)
                return
            self._pending.extend(chunks)

    def progress(self) -> None:
        """Post what the send queue has room for, then reap completions (any thread may call it)."""
        with self._lock:
            if self._qp is None or self._cq is None:
                return
            self._post()
            if self._inflight:
                self._poll()
            if self.broken is not None and not self._inflight:
                self._release()
            elif self.retired and not self._inflight and not self._pending:
                self._release()

    def _post(self) -> None:
        qp = self._qp
        assert qp is not None
        while self._pending and len(self._inflight) < self._depth and self.broken is None:
            chunk = self._pending[0]
            p = chunk.piece
            self._next_wr += 1
            wr = WorkRequest(self._next_wr, chunk.opcode, p.local_addr, p.length, p.lkey, p.remote_addr, p.rkey)
            try:
                qp.post_send(wr)
            except VerbsError as exc:
                self._break(ErrorCode.TRANSFER_FAILED, f"post_send: {exc}")
                return
            self._pending.popleft()
            self._inflight[wr.wr_id] = chunk
            self.work_requests += 1

    def _poll(self) -> None:
        cq = self._cq
        assert cq is not None
        try:
            completions = cq.poll(_POLL_BATCH)
        except VerbsError as exc:
            self._break(ErrorCode.TRANSFER_FAILED, f"poll: {exc}")
            self._fail_inflight(ErrorCode.TRANSFER_FAILED)
            return
        for wc in completions:
            chunk = self._inflight.pop(wc.wr_id, None)
            if chunk is None:
                continue
            code = completion_code(wc.status)
            if wc.status == WcStatus.WR_FLUSH_ERR and self.broken is not None:
                code = self.broken  # flushed because of an earlier failure or an abort: report that
            elif code != ErrorCode.OK:
                self._break(code, f"work completion {wc.status.name} (vendor error {wc.vendor_err:#x})")
            else:
                self.successes += 1
            chunk.batch.finish(chunk, code)

    def _break(self, code: ErrorCode, why: str) -> None:
        """Move the QP to ERR (outstanding work flushes) and fail everything not yet posted."""
        if self.broken is None:
            self.broken = code
            if code not in (ErrorCode.TIMEOUT, ErrorCode.SHUTTING_DOWN):
                logger.warning("rdma %s: %s; the QP is torn down and re-established on next use", self.endpoint, why)
            if self._qp is not None:
                try:
                    self._qp.to_error()
                except VerbsError as exc:
                    logger.debug("rdma %s: QP -> ERR: %s", self.endpoint, exc)
        pending, self._pending = self._pending, deque()
        for chunk in pending:
            chunk.batch.finish(chunk, self.broken if self.broken is not None else code)

    def _fail_inflight(self, code: ErrorCode) -> None:
        inflight, self._inflight = self._inflight, {}
        for chunk in inflight.values():
            chunk.batch.finish(chunk, code)

    def abort(self, code: ErrorCode, why: str) -> None:
        """Stop everything now: QP to ERR, wait (bounded) for the flush, destroy the QP.

        After this returns the NIC no longer touches any buffer of any request that was on this connection,
        so their callers may reuse the memory.
        """
        with self._lock:
            if self._qp is None:
                return
            if not self._inflight and not self._pending and self.broken is None:
                return  # nothing of ours in flight: keep the connection
            self._break(code, why)
            end = time.monotonic() + _ABORT_DRAIN_S
            while self._inflight and time.monotonic() < end and self._cq is not None:
                self._poll()
            self._fail_inflight(code)  # destroying the QP below stops the NIC for whatever did not flush
            self._release()

    def close(self) -> None:
        self.abort(ErrorCode.SHUTTING_DOWN, "transport closed")
        with self._lock:
            self.broken = self.broken or ErrorCode.SHUTTING_DOWN
            self._release()

    def _release(self) -> None:
        qp, cq, sock = self._qp, self._cq, self._sock
        self._qp = self._cq = self._sock = None
        if qp is not None:
            _close_quietly(qp)
        if cq is not None:
            _close_quietly(cq)
        if sock is not None:
            sock.close()  # the store releases its QP when this connection closes


@dataclass(eq=False)
class _Peer:
    """What this client knows about one store (by its TCP endpoint)."""

    endpoint: str
    segments: frozenset[int] = frozenset()
    rdma: bool = False
    conn: _Connection | None = None
    down_until: float = 0.0
    failures: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class RdmaStats:
    """Counters for tests and metrics."""

    connects: int = 0
    connect_failures: int = 0
    broken_connections: int = 0
    work_requests: int = 0
    bytes_submitted: int = 0


# ---------------------------------------------------------------------- the client transport
class RdmaTransport(Transport):
    """READ/WRITE of object ranges on stores with one-sided RDMA."""

    name = "rdma"

    def __init__(
        self,
        verbs: Verbs,
        device: str | None = None,
        max_mr_bytes: int | None = None,
        *,
        port: int = 1,
        gid_index: int = 0,
        token: bytes = b"",
        max_wr_bytes: int = DEFAULT_MAX_WR_BYTES,
        send_queue_depth: int = DEFAULT_SQ_DEPTH,
        connect_timeout: float = 2.0,
        reconnect_cooldown_s: float = 1.0,
        poll_interval_s: float = 0.0005,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if device is None:
            devices = verbs.list_devices()
            if not devices:
                raise KvPoolError(ErrorCode.NOT_SUPPORTED, "no RDMA device")
            device = devices[0]
        try:
            self._ctx = verbs.open(device, port, gid_index)
        except VerbsError as exc:
            raise KvPoolError(ErrorCode.NOT_SUPPORTED, f"cannot open RDMA device {device}: {exc}") from exc
        device_max = self._ctx.max_mr_bytes
        self.max_mr_bytes = min(max_mr_bytes or device_max, device_max)
        if self.max_mr_bytes <= 0 or max_wr_bytes <= 0:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "max_mr_bytes and max_wr_bytes must be positive")
        self.max_chunk_bytes = min(self.max_mr_bytes, max_wr_bytes)
        self.device = device
        self.send_queue_depth = max(1, min(send_queue_depth, self._ctx.max_qp_wr))
        self.connect_timeout = connect_timeout
        self.reconnect_cooldown_s = reconnect_cooldown_s
        self.stats = RdmaStats()
        self._token = token
        self._poll_interval = poll_interval_s
        self._clock = clock
        self._memory = _LocalMemory(self._ctx, self.max_mr_bytes)
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._closed = False

    # ---- what the client learns about stores
    def note_store_info(self, endpoint: str, info: Mapping[str, Any]) -> bool:
        """Feed a store's STORE_INFO; returns whether it advertises RDMA (``info["rdma"]["segments"]``)."""
        rdma = info.get("rdma")
        segments: list[int] = []
        if isinstance(rdma, Mapping):
            raw = rdma.get("segments", [])
            if isinstance(raw, list):
                segments = [s for s in raw if isinstance(s, int) and not isinstance(s, bool)]
        self.advertise(endpoint, segments)
        return bool(segments)

    def advertise(self, endpoint: str, segment_ids: Iterable[int]) -> None:
        """Record which segments the store at ``endpoint`` serves over RDMA (empty: none)."""
        ids = frozenset(segment_ids)
        peer = self._peer(endpoint)
        peer.segments, peer.rdma = ids, bool(ids)

    def can_reach(self, replica: Replica) -> bool:
        with self._lock:
            peer = None if self._closed else self._peers.get(replica.tcp_endpoint)
        return (
            peer is not None
            and peer.rdma
            and replica.segment_id in peer.segments
            and time.monotonic() >= peer.down_until
        )

    # ---- memory
    def register_memory(self, buffer: memoryview) -> None:
        view = _flat(buffer)
        if view.nbytes:
            self._memory.register(view)

    def unregister_memory(self, buffer: memoryview) -> None:
        view = _flat(buffer)
        if view.nbytes:
            self._memory.unregister(view)

    # ---- transfers
    def submit(self, requests: Sequence[TransferRequest], deadline: Deadline) -> TransferBatch:
        batch = _Batch(len(requests), deadline, self._poll_interval)
        by_endpoint: dict[str, list[tuple[int, TransferRequest, memoryview]]] = {}
        for index, req in enumerate(requests):
            view = self._check(index, req, batch)
            if view is not None and req.replica.length:
                by_endpoint.setdefault(req.replica.tcp_endpoint, []).append((index, req, view))
        for endpoint, items in by_endpoint.items():
            self._submit_to(endpoint, items, batch)
        for conn in batch.connections:
            conn.progress()  # post the first window now; wait() reaps
        return batch

    def _check(self, index: int, req: TransferRequest, batch: _Batch) -> memoryview | None:
        """The request's buffer as flat bytes, or None with its code set in ``batch``."""
        try:
            view = _flat(req.buffer)
        except (TypeError, ValueError):
            batch.fail(index, ErrorCode.INVALID_ARGUMENT)  # not C-contiguous
            return None
        length = req.replica.length
        code = ErrorCode.OK
        if len(req.key) > MAX_KEY_BYTES:
            code = ErrorCode.KEY_TOO_LONG
        elif req.op == GrantOp.READ and view.readonly:
            code = ErrorCode.INVALID_ARGUMENT
        elif req.op == GrantOp.READ and len(view) < length:
            code = ErrorCode.BUFFER_TOO_SMALL
        elif req.op == GrantOp.WRITE and len(view) != length:
            code = ErrorCode.INVALID_ARGUMENT
        elif req.replica.expiry_ms and req.replica.expiry_ms <= self._clock.wall_ms():
            # The store cannot check a one-sided request, so the client does: past its grant the range may
            # already belong to another object.
            code = ErrorCode.GRANT_EXPIRED
        if code != ErrorCode.OK:
            batch.fail(index, code)
            return None
        return view[:length]

    def _submit_to(self, endpoint: str, items: list[tuple[int, TransferRequest, memoryview]], batch: _Batch) -> None:
        grants: dict[int, Grant] = {}
        for _, req, _ in items:
            seg = req.replica.segment_id
            if seg not in grants or (req.op == GrantOp.WRITE and grants[seg].op != GrantOp.WRITE):
                grants[seg] = req.replica.grant(req.op, req.key)
        need_write = any(req.op == GrantOp.WRITE for _, req, _ in items)
        try:
            peer = self._peer(endpoint)
        except KvPoolError as exc:
            for index, _, _ in items:
                batch.fail(index, exc.code)
            return
        # Under the peer's lock from connection to enqueue: nobody retires (and closes) the connection
        # between our choosing it and our work being on it.
        with peer.lock:
            try:
                conn = self._connection(peer, list(grants.values()), need_write, batch.deadline)
            except KvPoolError as exc:
                for index, _, _ in items:
                    batch.fail(index, exc.code)
                return
            chunks: list[_Chunk] = []
            for index, req, view in items:
                chunks.extend(self._chunks(index, req, view, conn, batch))
            batch.add_chunks(chunks)
            with self._lock:
                self.stats.work_requests += len(chunks)
                self.stats.bytes_submitted += sum(c.piece.length for c in chunks)
            conn.enqueue(chunks)

    def _chunks(
        self, index: int, req: TransferRequest, view: memoryview, conn: _Connection, batch: _Batch
    ) -> list[_Chunk]:
        try:
            addr = buffer_address(view)
            reg = self._memory.find(addr, len(view))
            if reg is None:  # not registered: register for this batch only (slow; register_memory is the way)
                reg = self._memory.register(view, temporary=True)
                batch.temporary.append(reg)
            pieces = plan_pieces(
                addr,
                reg.spans(),
                req.replica.offset,
                conn.regions(req.replica.segment_id),
                len(view),
                self.max_chunk_bytes,
            )
        except KvPoolError as exc:
            batch.fail(index, exc.code)
            return []
        opcode = Opcode.RDMA_READ if req.op == GrantOp.READ else Opcode.RDMA_WRITE
        return [_Chunk(batch, conn, index, opcode, piece) for piece in pieces]

    # ---- connections
    def _peer(self, endpoint: str) -> _Peer:
        with self._lock:
            if self._closed:
                raise KvPoolError(ErrorCode.SHUTTING_DOWN, "transport closed")
            peer = self._peers.get(endpoint)
            if peer is None:
                peer = self._peers[endpoint] = _Peer(endpoint)
            return peer

    def _count(self, counter: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, counter, getattr(self.stats, counter) + n)

    def _connection(self, peer: _Peer, grants: list[Grant], need_write: bool, deadline: Deadline) -> _Connection:
        """A usable connection to the peer covering the grants' segments; connects when needed.

        Called with ``peer.lock`` held. A connection broken by a verbs error is replaced here (torn down and
        re-established on next use); after several in a row that never completed a work request (a store
        that advertises RDMA but is unreachable over it) the peer is put in cooldown, so TCP serves it.
        """
        segments = [g.segment_id for g in grants]
        conn = peer.conn
        if conn is not None and conn.usable and conn.covers(segments) and (conn.writable or not need_write):
            return conn
        if conn is not None:
            if conn.broken is not None:
                self._count("broken_connections")
                peer.failures = 0 if conn.successes else peer.failures + 1
                if peer.failures >= _FAILURES_BEFORE_COOLDOWN:
                    peer.failures = 0
                    peer.down_until = time.monotonic() + self.reconnect_cooldown_s
            conn.retired = True  # batches still on it finish there; it closes when idle
            conn.progress()
            peer.conn = None
        if time.monotonic() < peer.down_until:
            raise KvPoolError(ErrorCode.CONNECTION_FAILED, f"RDMA to {peer.endpoint}: reconnect cooldown")
        try:
            peer.conn = self._connect(peer.endpoint, grants, need_write, deadline)
        except KvPoolError as exc:
            self._count("connect_failures")
            if exc.code not in _REQUEST_REFUSALS:  # the path failed, not this request's grant: back off
                peer.down_until = time.monotonic() + self.reconnect_cooldown_s
            if exc.code in (ErrorCode.NOT_SUPPORTED, ErrorCode.UNKNOWN_OP):
                peer.rdma = False  # the store does not serve RDMA after all: TCP from now on
            logger.warning("rdma %s: connect failed: %s", peer.endpoint, exc)
            raise
        self._count("connects")
        return peer.conn

    def _connect(self, endpoint: str, grants: list[Grant], need_write: bool, deadline: Deadline) -> _Connection:
        remaining = deadline.remaining()
        timeout = self.connect_timeout if remaining is None else min(self.connect_timeout, remaining)
        if timeout <= 0:
            raise KvPoolError(ErrorCode.TIMEOUT, f"RDMA connect to {endpoint}: deadline passed")
        qp: QueuePair | None = None
        cq: CompletionQueue | None = None
        sock: socket.socket | None = None
        try:
            cq = self._ctx.create_cq(self.send_queue_depth * 2)
            qp = self._ctx.create_qp(cq, self.send_queue_depth)
            qp.to_init(Access.LOCAL_WRITE)
            port = self._ctx.port_info()
            local = QpInfo(qp.qp_num, port.lid, port.gid, secrets.randbits(24), port.mtu)
            request = {
                "qp": qp_info_to_json(local),
                "access": "rw" if need_write else "r",
                "grants": [grant_to_json(g) for g in grants],
            }
            sock, reply = exchange_rdma_connect(endpoint, _encode(request), token=self._token, timeout=timeout)
            doc = _decode(reply, "RDMA_CONNECT reply")
            remote = qp_info_from_json(doc.get("qp"))
            raw_regions = doc.get("regions")
            if not isinstance(raw_regions, list):
                raise KvPoolError(ErrorCode.BAD_FRAME, "RDMA_CONNECT reply: regions is not a list")
            regions = [RemoteRegion.from_json(r) for r in raw_regions]
            qp.to_rtr(remote, Mtu(min(port.mtu, remote.mtu)))
            qp.to_rts(local.psn)
        except VerbsError as exc:
            _cleanup(qp, cq, sock)
            raise KvPoolError(ErrorCode.TRANSFER_FAILED, f"RDMA connect to {endpoint}: {exc}") from exc
        except BaseException:
            _cleanup(qp, cq, sock)
            raise
        writable = doc.get("access") == "rw"
        logger.debug(
            "rdma %s: connected QP %d -> %d (%d regions, %s)",
            endpoint,
            local.qp_num,
            remote.qp_num,
            len(regions),
            "rw" if writable else "r",
        )
        return _Connection(endpoint, sock, qp, cq, regions, writable, self.send_queue_depth)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            with peer.lock:
                conn, peer.conn = peer.conn, None
            if conn is not None:
                conn.close()
        self._memory.close()
        _close_quietly(self._ctx)


def _flat(buffer: memoryview) -> memoryview:
    view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _cleanup(qp: QueuePair | None, cq: CompletionQueue | None, sock: socket.socket | None) -> None:
    if qp is not None:
        _close_quietly(qp)
    if cq is not None:
        _close_quietly(cq)
    if sock is not None:
        sock.close()


# ---------------------------------------------------------------------- the control exchange (client side)
def exchange_rdma_connect(
    endpoint: str, payload: bytes, *, token: bytes = b"", timeout: float = 2.0
) -> tuple[socket.socket, bytes]:
    """Send RDMA_CONNECT to a store's data-plane port; returns the still-open socket and the reply payload.

    HELLO (the cluster token) goes first when ``token`` is set, as on every framed connection. The socket is
    returned open: the QP lives as long as this connection (the store releases it when the socket closes).
    A refusal raises KvPoolError with the store's code (AUTH_FAILED, GRANT_EXPIRED, NOT_SUPPORTED, ...).
    """
    from kvpool.transfer.tcp import parse_endpoint

    address = parse_endpoint(endpoint)
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except TimeoutError:
        raise KvPoolError(ErrorCode.TIMEOUT, f"connect to {endpoint}: timed out") from None
    except OSError as exc:
        raise KvPoolError(ErrorCode.CONNECTION_FAILED, f"connect to {endpoint}: {exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if token:
            status, reply = _roundtrip(sock, Op.HELLO, 1, token)
            if status != ErrorCode.OK:
                raise KvPoolError(ErrorCode.AUTH_FAILED, f"{endpoint} refused the cluster token: {status.name}")
        status, reply = _roundtrip(sock, Op.RDMA_CONNECT, 2, payload)
        if status != ErrorCode.OK:
            raise KvPoolError(status, f"{endpoint} refused RDMA_CONNECT: {_reason(reply)}")
        sock.settimeout(None)
        return sock, reply
    except TimeoutError:
        sock.close()
        raise KvPoolError(ErrorCode.TIMEOUT, f"RDMA_CONNECT to {endpoint}: timed out") from None
    except OSError as exc:
        sock.close()
        raise KvPoolError(ErrorCode.CONNECTION_FAILED, f"RDMA_CONNECT to {endpoint}: {exc}") from None
    except BaseException:
        sock.close()
        raise


def _roundtrip(sock: socket.socket, op: Op, req_id: int, payload: bytes) -> tuple[ErrorCode, bytes]:
    sock.sendall(frames.pack_header(op, req_id, len(payload)) + payload)
    head = frames.recv_header(sock)
    if head.req_id != req_id:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"reply {head.req_id} to request {req_id}")
    if head.length > MAX_CONNECT_PAYLOAD:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"{Op(op).name} reply of {head.length} bytes")
    return as_code(head.status), bytes(frames.recv_exact(sock, head.length))


def _reason(reply: bytes) -> str:
    try:
        doc = json.loads(reply)
        return str(doc.get("error", "")) if isinstance(doc, dict) else ""
    except ValueError:
        return reply[:200].decode(errors="replace")


# ---------------------------------------------------------------------- the store side
@dataclass(eq=False)
class _Admitted:
    qp: QueuePair
    writable: bool
    segments: frozenset[int]


class RdmaResponder:
    """The store's half of RDMA: registers the segments and answers RDMA_CONNECT from the data plane.

    The data plane owns the sockets; for a frame with ``Op.RDMA_CONNECT`` it calls :meth:`handle_connect` with
    the payload and sends back the returned (status, payload). When that TCP connection closes it calls
    :meth:`release` with the same ``conn_id``, which destroys the QPs admitted on it. :meth:`advertisement` is
    what the store adds to STORE_INFO under ``"rdma"`` so clients know to use RDMA. Segments come and go with
    :meth:`add_segment` / :meth:`remove_segment` (which also cuts off every QP admitted to that segment);
    :meth:`revoke` cuts off QPs without removing anything (a rotated secret, a drain).

    Close the responder before unmapping the segments: its MRs pin their pages.
    """

    def __init__(
        self,
        verbs: Verbs,
        segments: Mapping[int, SegmentMemory],
        secrets_by_segment: Mapping[int, bytes],
        *,
        device: str | None = None,
        port: int = 1,
        gid_index: int = 0,
        max_mr_bytes: int | None = None,
        max_qps: int = 1024,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if device is None:
            devices = verbs.list_devices()
            if not devices:
                raise KvPoolError(ErrorCode.NOT_SUPPORTED, "no RDMA device")
            device = devices[0]
        self.device = device
        self.max_qps = max_qps
        self._clock = clock
        self._secrets = dict(secrets_by_segment)
        self._lock = threading.Lock()
        self._admitted: dict[Hashable, list[_Admitted]] = {}
        self._closed = False
        try:
            self._ctx = verbs.open(device, port, gid_index)
        except VerbsError as exc:
            raise KvPoolError(ErrorCode.NOT_SUPPORTED, f"cannot open RDMA device {device}: {exc}") from exc
        self.max_mr_bytes = min(max_mr_bytes or self._ctx.max_mr_bytes, self._ctx.max_mr_bytes)
        self._mrs: dict[int, list[MemoryRegion]] = {}
        self._regions: dict[int, list[RemoteRegion]] = {}
        try:
            self._cq = self._ctx.create_cq(16)  # store QPs post nothing; a CQ is still required
            for seg_id, segment in segments.items():
                self._register(seg_id, segment)
        except KvPoolError:
            self.close()
            raise

    def _register(self, segment_id: int, segment: SegmentMemory) -> None:
        base = buffer_address(segment.view)
        access = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
        try:
            mrs = register_chunked(self._ctx, base, segment.size, access, self.max_mr_bytes)
        except VerbsError as exc:
            raise KvPoolError(
                ErrorCode.TRANSFER_FAILED,
                f"cannot register segment {segment_id} for RDMA: {exc} (memlock ulimit? see docs/rdma.md)",
            ) from exc
        with self._lock:
            self._mrs[segment_id] = mrs
            self._regions[segment_id] = [
                RemoteRegion(segment_id, mr.addr - base, mr.length, mr.addr, mr.rkey) for mr in mrs
            ]

    def add_segment(self, segment_id: int, segment: SegmentMemory, secret: bytes) -> None:
        """Serve one more segment over RDMA (register it; its grants verify with ``secret``)."""
        self._register(segment_id, segment)
        with self._lock:
            self._secrets[segment_id] = secret

    def remove_segment(self, segment_id: int) -> list[Hashable]:
        """Stop serving a segment: cut off the QPs admitted to it (their ``conn_id`` is returned, see
        :meth:`revoke`), then deregister its MRs."""
        conns = self.revoke(segment_id)
        with self._lock:
            mrs = self._mrs.pop(segment_id, [])
            self._regions.pop(segment_id, None)
            self._secrets.pop(segment_id, None)
        for mr in mrs:
            _close_quietly(mr)
        return conns

    def revoke(self, segment_id: int | None = None) -> list[Hashable]:
        """Destroy the QPs admitted to ``segment_id`` (None: all); returns their connections' ``conn_id``.

        The caller should close those control connections: their clients then notice at once and reconnect
        with a fresh grant (otherwise their next work request fails with a retry timeout first).
        """
        with self._lock:
            victims: list[_Admitted] = []
            conns: list[Hashable] = []
            for conn_id, admitted in list(self._admitted.items()):
                keep = [a for a in admitted if segment_id is not None and segment_id not in a.segments]
                if len(keep) == len(admitted):
                    continue
                conns.append(conn_id)
                victims.extend(a for a in admitted if a not in keep)
                if keep:
                    self._admitted[conn_id] = keep
                else:
                    del self._admitted[conn_id]
        for entry in victims:
            _close_quietly(entry.qp)
        return conns

    # ---- what the data plane calls
    def advertisement(self) -> dict[str, Any]:
        """The ``"rdma"`` entry of STORE_INFO."""
        with self._lock:
            segments = sorted(self._regions)
        return {"v": PROTOCOL_VERSION, "device": self.device, "segments": segments}

    @property
    def connections(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._admitted.values())

    def handle_connect(
        self, payload: bytes | bytearray | memoryview, *, conn_id: Hashable, token_verified: bool = False
    ) -> tuple[ErrorCode, bytes]:
        """Answer one RDMA_CONNECT: (status for the reply header, reply payload). Never raises.

        ``token_verified`` says the connection presented the cluster token (HELLO); without it the request
        must carry a valid, unexpired master grant for every segment it wants.
        """
        try:
            return ErrorCode.OK, self._connect(payload, conn_id, token_verified)
        except KvPoolError as exc:
            if exc.code != ErrorCode.BAD_FRAME:
                logger.info("RDMA_CONNECT refused: %s", exc)
            return exc.code, json.dumps({"error": exc.message}).encode()
        except VerbsError as exc:
            logger.warning("RDMA_CONNECT failed: %s", exc)
            return ErrorCode.TRANSFER_FAILED, json.dumps({"error": str(exc)}).encode()

    def release(self, conn_id: Hashable) -> int:
        """Destroy the QPs admitted on a closed control connection; returns how many."""
        with self._lock:
            admitted = self._admitted.pop(conn_id, [])
        for entry in admitted:
            _close_quietly(entry.qp)
        return len(admitted)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._admitted = list(self._admitted.values()), {}
        for admitted in conns:
            for entry in admitted:
                _close_quietly(entry.qp)
        for mrs in self._mrs.values():
            for mr in mrs:
                _close_quietly(mr)
        self._mrs = {}
        cq = getattr(self, "_cq", None)
        if cq is not None:
            _close_quietly(cq)
        _close_quietly(self._ctx)

    # ---- inside
    def _connect(self, payload: bytes | bytearray | memoryview, conn_id: Hashable, token_verified: bool) -> bytes:
        doc = _decode(payload, "RDMA_CONNECT")
        remote = qp_info_from_json(doc.get("qp"))
        raw_grants = doc.get("grants", [])
        if not isinstance(raw_grants, list) or len(raw_grants) > 64:
            raise KvPoolError(ErrorCode.BAD_FRAME, "RDMA_CONNECT: grants must be a list of at most 64")
        segments, writable = self._authorize([grant_from_json(g) for g in raw_grants], token_verified)
        writable = writable and doc.get("access") == "rw"
        with self._lock:
            if self._closed:
                raise KvPoolError(ErrorCode.SHUTTING_DOWN, "store is stopping")
            if sum(len(v) for v in self._admitted.values()) >= self.max_qps:
                raise KvPoolError(ErrorCode.TOO_MANY_CONNECTIONS, f"{self.max_qps} RDMA connections already")
        qp = self._ctx.create_qp(self._cq, 1)
        try:
            access = Access.LOCAL_WRITE | Access.REMOTE_READ
            if writable:
                access |= Access.REMOTE_WRITE
            qp.to_init(access)
            port = self._ctx.port_info()
            mtu = Mtu(min(port.mtu, remote.mtu))
            qp.to_rtr(remote, mtu)
            psn = secrets.randbits(24)
            qp.to_rts(psn)
        except BaseException:
            _close_quietly(qp)
            raise
        with self._lock:
            self._admitted.setdefault(conn_id, []).append(_Admitted(qp, writable, segments))
        with self._lock:
            regions = [r.to_json() for s in sorted(segments) for r in self._regions.get(s, [])]
        local = QpInfo(qp.qp_num, port.lid, port.gid, psn, mtu)
        return _encode({"qp": qp_info_to_json(local), "access": "rw" if writable else "r", "regions": regions})

    def _authorize(self, grants: list[Grant], token_verified: bool) -> tuple[frozenset[int], bool]:
        """Which segments the peer may reach and whether it may write.

        A token holder may reach every segment and write; otherwise each grant must verify with its
        segment's secret and be unexpired, and a WRITE grant is what allows writes.
        """
        now = self._clock.wall_ms()
        with self._lock:
            secrets_now, served = dict(self._secrets), set(self._regions)
        segments: set[int] = set()
        writable = token_verified
        for grant in grants:
            seg = grant.segment_id
            secret = secrets_now.get(seg)
            if secret is None or seg not in served:
                raise KvPoolError(ErrorCode.SEGMENT_NOT_FOUND, f"segment {seg} is not served here")
            if not verify(secret, grant):
                raise KvPoolError(ErrorCode.AUTH_FAILED, f"the grant for segment {seg} does not verify")
            if grant.expiry_ms and grant.expiry_ms <= now:
                raise KvPoolError(ErrorCode.GRANT_EXPIRED, f"the grant for segment {seg} expired")
            segments.add(grant.segment_id)
            writable = writable or grant.op == GrantOp.WRITE
        if token_verified:
            segments = served
        if not segments:
            raise KvPoolError(ErrorCode.AUTH_FAILED, "RDMA_CONNECT needs the cluster token or a master grant")
        return frozenset(segments), writable
