"""One RDMA connection of the client (:class:`RdmaTransport` in :mod:`~kvpool.transfer.rdma_client`): an RC QP
to one store, its CQ and the control socket that keeps it alive; queueing, posting (chained windows of work
requests) and completions of the chunks of batches, RECORD exchanges of per-grant windows, and the abort and
release of a broken connection. ``completion_code`` maps a work completion status to the ErrorCode a request gets.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterable, Sequence

from kvpool.common.clock import SYSTEM_CLOCK, Clock, Deadline
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.grants import Grant, GrantOp
from kvpool.common.log import get_logger
from kvpool.proto import frames
from kvpool.transfer.base import TransferRequest
from kvpool.transfer.rdma_batch import _Chunk
from kvpool.transfer.rdma_memory import _close_quietly
from kvpool.transfer.rdma_windows import ClientWindows
from kvpool.transfer.rdma_wire import RemoteRegion
from kvpool.transfer.verbs import Completion, CompletionQueue, QueuePair, VerbsError, WcStatus, WorkRequest

logger = get_logger(__name__)

_POLL_BATCH = 64
_ABORT_DRAIN_S = 1.0  # how long an aborted QP may take to flush before it is destroyed regardless
_RECORD_REQ_BASE = 16  # RECORD request ids on a control connection (1 and 2 were HELLO and RDMA_CONNECT)
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


class _InFlight:
    """The chunks on the NIC by wr_id. A connection's wr_ids are consecutive, so this is a list from ``base``
    on, extended a window at a time (decision 0027: no per-work-request insert on the posting path);
    completions, which an RC QP delivers in posting order, empty it from the front."""

    __slots__ = ("base", "chunks", "count", "front")

    def __init__(self, base: int) -> None:
        self.base = base
        """The wr_id of ``chunks[0]``; the next window starts at ``base + len(chunks)``."""
        self.chunks: list[_Chunk | None] = []
        self.count = 0
        self.front = 0  # chunks before this index are all completed

    def __len__(self) -> int:
        return self.count

    def add(self, chunks: list[_Chunk]) -> None:
        self.chunks.extend(chunks)
        self.count += len(chunks)

    def pop(self, wr_id: int) -> _Chunk | None:
        index = wr_id - self.base
        if not 0 <= index < len(self.chunks):
            return None
        chunk = self.chunks[index]
        if chunk is None:
            return None
        self.chunks[index] = None
        self.count -= 1
        if self.count == 0:
            self.base += len(self.chunks)
            self.chunks, self.front = [], 0
        elif index == self.front:
            self._trim()
        return chunk

    def _trim(self) -> None:
        chunks, front = self.chunks, self.front
        while front < len(chunks) and chunks[front] is None:
            front += 1
        if front >= 1024 and 2 * front >= len(chunks):
            del chunks[:front]
            self.base += front
            front = 0
        self.front = front

    def take_all(self) -> list[_Chunk]:
        out = [c for c in self.chunks if c is not None]
        self.base += len(self.chunks)
        self.chunks, self.count, self.front = [], 0, 0
        return out


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
        self._pending: list[_Chunk] = []
        """Chunks queued; those before ``_head`` are posted or failed already (the list is cut when empty)."""
        self._head = 0
        self._next_wr = 0
        self._inflight = _InFlight(self._next_wr + 1)
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
            if self._head:
                del self._pending[: self._head]
                self._head = 0
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
            elif self.retired and not self._inflight and self._head >= len(self._pending):
                self._release()

    def _post(self) -> None:
        if self._head >= len(self._pending) or self.broken is not None or self._inflight.count >= self._depth:
            return  # nothing to post, or no room yet: no posting time to count
        started = time.thread_time()
        try:
            self._post_window()
        finally:
            self.post_seconds += time.thread_time() - started

    def _post_window(self) -> None:
        """Post what the send queue has room for: one list through ``post_chunks`` (built in C by the compiled
        layer, decision 0027), or one work request at a time where ``chained`` is off (the figure decision 0021
        compares with). The in-flight map is filled a window at a time; a chunk whose grant expired is failed
        alone, never posted: its window may be gone (or go while the request is on the NIC), and a request that
        hits a dead window kills the QP with everyone's work on it (decision 0024)."""
        qp = self._qp
        assert qp is not None
        pending = self._pending
        while self._head < len(pending) and self.broken is None:
            room = self._depth - self._inflight.count
            if room <= 0:
                break
            start, first = self._head, self._next_wr + 1
            stop = min(len(pending), start + room)
            if self.chained:
                posted, refusal, expired = qp.post_chunks(pending, start, stop, first, self._clock.wall_ms())
            else:
                posted, refusal, expired = self._post_one_by_one(qp, pending, start, stop, first)
            self._inflight.add(pending[start : start + posted])
            self._next_wr += posted
            self.work_requests += posted
            self._head = start + posted
            if refusal is not None:
                self._break(ErrorCode.TRANSFER_FAILED, f"post_send: {refusal}")  # fails the ones not posted
                break
            if not expired:
                break
            chunk = pending[self._head]
            self._head += 1
            chunk.batch.finish(chunk, ErrorCode.GRANT_EXPIRED)
        if self._head >= len(pending):
            self._pending, self._head = [], 0

    def _post_one_by_one(
        self, qp: QueuePair, chunks: list[_Chunk], start: int, stop: int, first: int
    ) -> tuple[int, VerbsError | None, bool]:
        now_ms = self._clock.wall_ms()
        for posted, chunk in enumerate(chunks[start:stop]):
            if chunk.expiry_ms and chunk.expiry_ms <= now_ms:
                return posted, None, True
            p = chunk.piece
            try:
                qp.post_send(
                    WorkRequest(first + posted, chunk.opcode, p.local_addr, p.length, p.lkey, p.remote_addr, p.rkey)
                )
            except VerbsError as exc:
                return posted, exc, False
        return stop - start, None, False

    def _poll(self) -> None:
        """Reap the completions there are (up to a send queue's worth): the next window can then be as deep as
        the send queue, which halves the posting calls against reaping one poll batch at a time."""
        cq = self._cq
        assert cq is not None
        completions: list[Completion] = []
        try:
            while len(completions) < self._depth:
                polled = cq.poll(_POLL_BATCH)
                completions.extend(polled)
                if len(polled) < _POLL_BATCH:
                    break
        except VerbsError as exc:
            self._break(ErrorCode.TRANSFER_FAILED, f"poll: {exc}")
            self._dispatch(completions)
            self._fail_inflight(ErrorCode.TRANSFER_FAILED)
            return
        self._dispatch(completions)

    def _dispatch(self, completions: list[Completion]) -> None:
        for wc in completions:
            chunk = self._inflight.pop(wc.wr_id)
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
        pending = self._pending[self._head :]
        self._pending, self._head = [], 0
        for chunk in pending:
            chunk.batch.finish(chunk, self.broken if self.broken is not None else code)

    def _fail_inflight(self, code: ErrorCode) -> None:
        for chunk in self._inflight.take_all():
            chunk.batch.finish(chunk, code)

    def abort(self, code: ErrorCode, why: str) -> None:
        """Stop everything now: QP to ERR, wait (bounded) for the flush, destroy the QP.

        After this returns the NIC no longer touches any buffer of any request that was on this connection,
        so their callers may reuse the memory.
        """
        with self._lock:
            if self._qp is None:
                return
            if not self._inflight and self._head >= len(self._pending) and self.broken is None:
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
