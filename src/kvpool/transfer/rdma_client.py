"""The client half of RDMA: :class:`RdmaTransport`, its connections (one RC QP per store), batches
and completion handling. The overview is in :mod:`kvpool.transfer.rdma`.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvpool.common.clock import SYSTEM_CLOCK, Clock, Deadline
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.grants import Grant, GrantOp
from kvpool.common.log import get_logger
from kvpool.proto import frames
from kvpool.proto.frames import MAX_KEY_BYTES
from kvpool.transfer.base import Replica, TransferBatch, TransferRequest, Transport
from kvpool.transfer.rdma_batch import _Batch, _Chunk
from kvpool.transfer.rdma_memory import _close_quietly, _LocalMemory, plan_pieces
from kvpool.transfer.rdma_windows import ClientWindows
from kvpool.transfer.rdma_wire import (
    RemoteRegion,
    _decode,
    _encode,
    exchange_rdma_connect,
    fetch_store_info,
    grant_to_json,
    qp_info_from_json,
    qp_info_to_json,
)
from kvpool.transfer.verbs import (
    Access,
    CompletionQueue,
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

DEFAULT_MAX_WR_BYTES = 1 << 30
DEFAULT_SQ_DEPTH = 128
_POLL_BATCH = 64
_ABORT_DRAIN_S = 1.0  # how long an aborted QP may take to flush before it is destroyed regardless
_FAILURES_BEFORE_COOLDOWN = 3
WINDOW_EXPIRY_MARGIN_MS = 1000
"""A grant with less than this left goes over TCP: RDMA spends a round trip on its window first, and a grant that
expires before its work request is posted fails that request (decision 0024)."""
_RECORD_REQ_BASE = 16  # RECORD request ids on a control connection (1 and 2 were HELLO and RDMA_CONNECT)
_LEARN_TIMEOUT_S = 0.5  # can_reach has no deadline: a store slow to say STORE_INFO is served over TCP meanwhile
_RELEARN_S = 1.0  # a store met again with an unknown segment (restarted) is asked STORE_INFO again after this

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
        windowed_segments: frozenset[int] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.endpoint = endpoint
        self.writable = writable
        self.windows = ClientWindows(clock) if windowed_segments is not None else None
        """Per-grant windows (the store binds one per grant); None: the segments' regions came at connect."""
        self._windowed_segments = windowed_segments or frozenset()
        self._sock: socket.socket | None = sock
        self._qp: QueuePair | None = qp
        self._cq: CompletionQueue | None = cq
        self._regions: dict[int, list[RemoteRegion]] = {}
        for region in regions:
            self._regions.setdefault(region.segment_id, []).append(region)
        self._depth = depth
        self._clock = clock
        self.chained = True
        """Post each window of work requests as one chained list (False: one ``post_send`` each)."""
        self._lock = threading.Lock()
        self._record_lock = threading.Lock()  # one RECORD exchange at a time on the control connection
        self._pending: deque[_Chunk] = deque()
        self._inflight: dict[int, _Chunk] = {}
        self._next_wr = 0
        self.broken: ErrorCode | None = None
        self.retired = False
        self.work_requests = 0
        self.successes = 0
        self.post_seconds = 0.0
        """CPU time this process's posting threads spent posting work requests (thread CPU time, so that a
        thread descheduled on a loaded machine does not count; a fake NIC's copy included: see
        RdmaTransport.post_us_per_wr)."""

    # ---- queries
    def covers(self, segment_ids: Iterable[int]) -> bool:
        if self.windows is not None:
            return all(s in self._windowed_segments for s in segment_ids)
        return all(s in self._regions for s in segment_ids)

    def window_regions(
        self, items: Sequence[tuple[Grant, int]], deadline: Deadline
    ) -> list[tuple[ErrorCode, list[RemoteRegion]]]:
        """The windows of these (grant, checksum) pairs, asked on the control connection when not cached."""
        assert self.windows is not None
        with self._record_lock:
            sock = self._sock
            if sock is None:
                return [(self.broken or ErrorCode.CONNECTION_FAILED, [])] * len(items)
            try:
                return self.windows.get(sock, items, max(0.001, deadline.remaining() or 5.0))
            except (OSError, KvPoolError) as exc:
                code = exc.code if isinstance(exc, KvPoolError) else ErrorCode.CONNECTION_FAILED
                with self._lock:
                    self._break(code, f"RDMA_WINDOWS failed: {exc}")
                return [(code, [])] * len(items)

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
        started = time.thread_time()
        try:
            self._post_window()
        finally:
            self.post_seconds += time.thread_time() - started

    def _post_window(self) -> None:
        """Post what the send queue has room for: one chained list (``post_send_list``), or one work request
        at a time where ``chained`` is off (the figure decision 0021 compares with)."""
        qp = self._qp
        assert qp is not None
        if not self._pending or self.broken is not None:
            return
        now_ms = self._clock.wall_ms()
        ready: list[_Chunk] = []
        wrs: list[WorkRequest] = []
        while self._pending and len(self._inflight) + len(ready) < self._depth:
            chunk = self._pending.popleft()
            if chunk.expiry_ms and chunk.expiry_ms <= now_ms:
                # Its window may be gone (or go while the request is on the NIC), and a request that hits a
                # dead window kills the QP with everyone's work on it: fail just this one (decision 0024).
                chunk.batch.finish(chunk, ErrorCode.GRANT_EXPIRED)
                continue
            p = chunk.piece
            self._next_wr += 1
            wrs.append(WorkRequest(self._next_wr, chunk.opcode, p.local_addr, p.length, p.lkey, p.remote_addr, p.rkey))
            ready.append(chunk)
        if not wrs:
            return
        if self.chained:
            posted = qp.post_send_list(wrs)
            refusal = qp.last_post_error
        else:
            posted, refusal = self._post_one_by_one(qp, wrs)
        for wr, chunk in zip(wrs[:posted], ready[:posted], strict=True):
            self._inflight[wr.wr_id] = chunk
        self.work_requests += posted
        if posted < len(wrs):
            self._pending.extendleft(reversed(ready[posted:]))  # not posted: failed by _break below
            self._break(ErrorCode.TRANSFER_FAILED, f"post_send: {refusal}")

    @staticmethod
    def _post_one_by_one(qp: QueuePair, wrs: list[WorkRequest]) -> tuple[int, VerbsError | None]:
        for posted, wr in enumerate(wrs):
            try:
                qp.post_send(wr)
            except VerbsError as exc:
                return posted, exc
        return len(wrs), None

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

    def record(self, requests: Sequence[TransferRequest], deadline: Deadline) -> list[ErrorCode]:
        """Pipeline one RECORD per written object on the control connection; the store's code for each."""
        out = []
        for n, req in enumerate(requests):
            desc = frames.TransferDesc(
                req.replica.grant(GrantOp.WRITE, req.key), req.write_checksum(), 0, req.replica.length
            ).pack()
            out.append(frames.pack_header(frames.Op.RECORD, _RECORD_REQ_BASE + n, len(desc)) + desc)
        with self._record_lock:
            sock = self._sock
            if sock is None:
                return [self.broken or ErrorCode.CONNECTION_FAILED] * len(requests)
            try:
                sock.settimeout(max(0.001, deadline.remaining() or 5.0))
                sock.sendall(b"".join(out))
                codes = []
                for n in range(len(requests)):
                    head = frames.recv_header(sock)
                    if head.req_id != _RECORD_REQ_BASE + n or head.length:
                        raise KvPoolError(ErrorCode.BAD_FRAME, "RECORD answer out of order")
                    codes.append(as_code(head.status))
                sock.settimeout(None)
                return codes
            except (OSError, KvPoolError) as exc:
                code = exc.code if isinstance(exc, KvPoolError) else ErrorCode.CONNECTION_FAILED
                logger.warning("rdma %s: RECORD failed: %s", self.endpoint, exc)
                with self._lock:
                    self._break(code, f"RECORD failed: {exc}")
                return [code] * len(requests)

    def _release(self) -> None:
        qp, cq, sock = self._qp, self._cq, self._sock
        self._qp = self._cq = self._sock = None
        if qp is not None:
            _close_quietly(qp)
        if cq is not None:
            _close_quietly(cq)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a RECORD exchange blocked on it
            sock.close()  # the store releases its QP when this connection closes


@dataclass(eq=False)
class _Peer:
    """What this client knows about one store (by its TCP endpoint)."""

    endpoint: str
    segments: frozenset[int] = frozenset()
    rdma: bool = False
    devices: tuple[str, ...] = ()
    """The store's RDMA devices (STORE_INFO); a client's rail N connects to device N modulo their number."""
    conn: _Connection | None = None
    down_until: float = 0.0
    failures: int = 0
    learned_at: float = float("-inf")
    """When STORE_INFO was last asked (time.monotonic)."""
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Item(NamedTuple):
    """One request of a batch to one store: its position in the batch, the request, the bytes to move (the part of the
    object's buffer) and where that part starts within the object."""

    position: int
    req: TransferRequest
    view: memoryview
    part_offset: int


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
        discover: bool = False,
        rail: int = 0,
    ) -> None:
        self.discover = discover
        self.rail = rail
        """Which of the store's devices this transport connects to (rail modulo their number): a client with
        several NICs runs one transport per NIC (``rdma_rails.RailsTransport``)."""
        self.on_learn: Callable[[str, Mapping[str, Any]], None] | None = None
        """Told every STORE_INFO this transport fetched (the other rails learn the store from it)."""
        """Ask unknown stores for STORE_INFO on first sight (else only :meth:`note_store_info` tells)."""
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
        self._all_connections: list[_Connection] = []  # for the posting-cost figure
        self._closed = False

    # ---- what the client learns about stores
    def note_store_info(self, endpoint: str, info: Mapping[str, Any]) -> bool:
        """Feed a store's STORE_INFO; returns whether it advertises RDMA (``info["rdma"]["segments"]``)."""
        rdma = info.get("rdma")
        segments: list[int] = []
        devices: tuple[str, ...] = ()
        if isinstance(rdma, Mapping):
            raw = rdma.get("segments", [])
            if isinstance(raw, list):
                segments = [s for s in raw if isinstance(s, int) and not isinstance(s, bool)]
            names = rdma.get("devices")
            if isinstance(names, list):
                devices = tuple(n for n in names if isinstance(n, str))
        self.advertise(endpoint, segments)
        self._peer(endpoint).devices = devices
        return bool(segments)

    def advertise(self, endpoint: str, segment_ids: Iterable[int]) -> None:
        """Record which segments the store at ``endpoint`` serves over RDMA (empty: none)."""
        ids = frozenset(segment_ids)
        peer = self._peer(endpoint)
        peer.segments, peer.rdma = ids, bool(ids)

    def can_reach(self, replica: Replica) -> bool:
        if replica.tier != 0:
            return False  # SSD-tier objects are read from files by the store: TCP serves them
        if replica.expiry_ms - self._clock.wall_ms() < WINDOW_EXPIRY_MARGIN_MS:
            # A grant this close to its end would likely expire between its RDMA_WINDOWS round trip and its
            # post (that request would then fail, decision 0024): TCP, where the store checks it once, at the
            # request. So does a replica without a lease (expiry 0: a hint the store must revalidate, which only
            # TCP asks it to do).
            return False
        with self._lock:
            peer = None if self._closed else self._peers.get(replica.tcp_endpoint)
        if self.discover and (peer is None or replica.segment_id not in peer.segments):
            peer = self._learn(replica.tcp_endpoint, peer)
        return (
            peer is not None
            and peer.rdma
            and replica.segment_id in peer.segments
            and time.monotonic() >= peer.down_until
        )

    def _learn(self, endpoint: str, known: _Peer | None) -> _Peer | None:
        """Ask a store we have not met (or that no longer has the segment we know) whether it serves RDMA."""
        now = time.monotonic()
        if known is not None and now - known.learned_at < _RELEARN_S:
            return known
        try:
            peer = self._peer(endpoint)
        except KvPoolError:
            return None
        peer.learned_at = now
        try:
            info = fetch_store_info(endpoint, token=self._token, timeout=_LEARN_TIMEOUT_S)
        except KvPoolError as exc:
            logger.debug("rdma: STORE_INFO from %s failed: %s", endpoint, exc)
            return peer
        if not self.note_store_info(endpoint, info):
            logger.info("store %s serves no RDMA: TCP is used for it", endpoint)
        if self.on_learn is not None:
            self.on_learn(endpoint, info)
        return peer

    def post_us_per_wr(self) -> float | None:
        """Client CPU microseconds per work request posted, with a fake NIC's checks and copy taken out
        (a real NIC does those itself); None before any work request was posted."""
        seconds, posted = self.posting_totals()
        if not posted:
            return None
        nic = float(getattr(self.nic_fabric(), "nic_seconds", 0.0))
        return max(0.0, seconds - nic) / posted * 1e6

    def posting_totals(self) -> tuple[float, int]:
        """(CPU seconds spent posting, work requests posted) over every connection so far."""
        with self._lock:
            conns = list(self._all_connections)
        return sum(c.post_seconds for c in conns), sum(c.work_requests for c in conns)

    def nic_fabric(self) -> object | None:
        """A fake NIC's fabric (it keeps ``nic_seconds``); None on real hardware."""
        return getattr(self._ctx, "fabric", None)

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
        return self.submit_parts(requests, None, deadline)

    def submit_parts(
        self,
        requests: Sequence[TransferRequest],
        parts: Sequence[tuple[int, int]] | None,
        deadline: Deadline,
        record: bool = True,
    ) -> _Batch:
        """Like :meth:`submit`, moving only the byte range (offset, length) of each object ``parts`` gives
        (None: whole objects); ``record=False`` leaves the RECORD of written objects to the caller (another
        rail may still be writing the rest of an object)."""
        batch = _Batch(len(requests), deadline, self._poll_interval, self._clock)
        batch.record = record
        by_endpoint: dict[str, list[_Item]] = {}
        for index, req in enumerate(requests):
            view = self._check(index, req, batch)
            offset = 0
            if view is not None and parts is not None:
                offset, length = parts[index]
                if not 0 <= offset <= offset + length <= len(view):
                    batch.fail(index, ErrorCode.INVALID_ARGUMENT)
                    continue
                view = view[offset : offset + length]
            if view is not None and len(view):
                by_endpoint.setdefault(req.replica.tcp_endpoint, []).append(_Item(index, req, view, offset))
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

    def _submit_to(self, endpoint: str, items: list[_Item], batch: _Batch) -> None:
        grants: dict[int, Grant] = {}
        for _, req, _, _ in items:
            seg = req.replica.segment_id
            # Admission needs one valid grant per segment: the write one where there is a write, else the one
            # that lives longest (a grant expiring while the QP connects would fail the whole batch).
            grant = req.replica.grant(req.op, req.key)
            held = grants.get(seg)
            if (
                held is None
                or (grant.op == GrantOp.WRITE and held.op != GrantOp.WRITE)
                or (grant.op == held.op and grant.expiry_ms > held.expiry_ms)
            ):
                grants[seg] = grant
        need_write = any(req.op == GrantOp.WRITE for _, req, _, _ in items)
        try:
            peer = self._peer(endpoint)
        except KvPoolError as exc:
            for index, _, _, _ in items:
                batch.fail(index, exc.code)
            return
        # Under the peer's lock from connection to enqueue: nobody retires (and closes) the connection
        # between our choosing it and our work being on it.
        with peer.lock:
            try:
                conn = self._connection(peer, list(grants.values()), need_write, batch.deadline)
            except KvPoolError as exc:
                for index, _, _, _ in items:
                    batch.fail(index, exc.code)
                return
            regions = self._regions_for(conn, items, batch)
            chunks: list[_Chunk] = []
            for item, remote in zip(items, regions, strict=True):
                if remote is not None:
                    chunks.extend(self._chunks(item, conn, batch, remote))
            batch.add_chunks(chunks)
            batch.writes.extend((index, req, conn) for index, req, _, _ in items if req.op == GrantOp.WRITE)
            with self._lock:
                self.stats.work_requests += len(chunks)
                self.stats.bytes_submitted += sum(c.piece.length for c in chunks)
            conn.enqueue(chunks)

    def _regions_for(self, conn: _Connection, items: list[_Item], batch: _Batch) -> list[list[RemoteRegion] | None]:
        """The remote regions each request may touch: its grant's windows, or the segment's regions on a
        store without windows; None (with the code set in ``batch``) where the store refused the grant."""
        if conn.windows is None:
            return [conn.regions(req.replica.segment_id) for _, req, _, _ in items]
        asks = [
            (req.replica.grant(req.op, req.key), req.write_checksum() if req.op == GrantOp.WRITE else 0)
            for _, req, _, _ in items
        ]
        out: list[list[RemoteRegion] | None] = []
        for (index, _, _, _), (code, regions) in zip(items, conn.window_regions(asks, batch.deadline), strict=True):
            if code != ErrorCode.OK:
                batch.fail(index, code)
                out.append(None)
            else:
                out.append(regions)
        return out

    def _chunks(self, item: _Item, conn: _Connection, batch: _Batch, remote: list[RemoteRegion]) -> list[_Chunk]:
        index, req, view, part_offset = item
        try:
            addr = buffer_address(view)
            reg = self._memory.find(addr, len(view))
            if reg is None:  # not registered: register for this batch only (slow; register_memory is the way)
                reg = self._memory.register(view, temporary=True)
                batch.temporary.append(reg)
            pieces = plan_pieces(
                addr,
                reg.spans(),
                req.replica.offset + part_offset,
                remote,
                len(view),
                self.max_chunk_bytes,
            )
        except KvPoolError as exc:
            batch.fail(index, exc.code)
            return []
        opcode = Opcode.RDMA_READ if req.op == GrantOp.READ else Opcode.RDMA_WRITE
        expiry = req.replica.expiry_ms
        return [_Chunk(batch, conn, index, opcode, piece, expiry) for piece in pieces]

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
            device = peer.devices[self.rail % len(peer.devices)] if peer.devices else None
            peer.conn = self._connect(peer.endpoint, grants, need_write, deadline, device)
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

    def _connect(
        self, endpoint: str, grants: list[Grant], need_write: bool, deadline: Deadline, device: str | None = None
    ) -> _Connection:
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
            if device is not None:
                request["device"] = device  # the store's NIC to reach (a store with several serves on each)
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
        windowed = _windowed_segments(doc)
        conn = _Connection(endpoint, sock, qp, cq, regions, writable, self.send_queue_depth, windowed, self._clock)
        with self._lock:
            self._all_connections.append(conn)
        return conn

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


def _windowed_segments(doc: dict[str, Any]) -> frozenset[int] | None:
    """The segments admitted on a connection whose store binds a window per grant; None: no windows."""
    if doc.get("windows") is not True:
        return None
    raw = doc.get("segments")
    if not isinstance(raw, list):
        raise KvPoolError(ErrorCode.BAD_FRAME, "RDMA_CONNECT reply: segments is not a list")
    return frozenset(s for s in raw if isinstance(s, int) and not isinstance(s, bool))


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
