"""The TCP transport: the default data path, runs everywhere.

Shape (docs/architecture.md, "Data plane and grants", and the lessons from Mooncake's TCP path):

* **Lanes.** Each endpoint (a store's ``host:port``) gets up to ``connections_per_endpoint`` lanes; a lane
  is one persistent connection with its own thread and an unbounded queue of jobs. Lanes are created
  lazily; each connects when it first has work, from the thread running that work, so connects run in
  parallel and a dead or slow peer only stalls the lanes of that peer - no serial handshake, no shared
  queue to overflow. A failed connect gives CONNECTION_FAILED to that peer's requests, and fails them fast
  for ``reconnect_cooldown_s``; a broken connection is discarded and re-created on next use.
* **Parts.** ``submit`` splits each object into parts (objects over ``stripe_bytes`` are striped in
  near-equal parts, unless a batch holds enough of them to keep every lane busy whole), and deals the
  parts to the endpoint's lanes, least-loaded first, so one large object is moved over all connections
  at once and many small ones are spread round-robin.
* **Pipelining with a bounded window.** A lane sends up to ``window`` requests ahead and reads responses in
  order. Deadlock on full socket buffers (we block sending requests while the store blocks sending us
  responses we are not reading) is ruled out per connection, from the buffer sizes the kernel really
  granted: the response bytes in flight fit in our receive buffer, and the request frames in flight fit
  in our send buffer; READs and WRITEs are never in flight together on one connection. Payload bytes in
  flight are also capped (``inflight_bytes``, default two stripes and at least 2 MiB): deeper pipelines
  only leave data cold in socket buffers, which measured slower on loopback. READ requests are sent half a
  window at a time in one vectored ``sendmsg``: a batch of small reads costs a syscall (and a store
  wake-up) per burst, not per request.
* **READV / WRITEV.** A run of small READ (WRITE) parts, each under ``VECTOR_MAX_PART``, goes in one
  READV (WRITEV) frame, answered with one code per part (and a READV's bytes, received with one
  ``recvmsg_into``): decision 0011. Each new connection asks first with an empty READV; a store that
  does not know the ops answers UNKNOWN_OP, and that connection (reopened) carries plain READs and WRITEs.
* **Threads.** Lane threads move the bytes, so ``submit`` returns at once and an engine thread is never
  blocked by the network. ``wait`` helps: a job no lane thread has started yet is run by the waiting
  thread itself (it would only block), and ``transfer`` does not even wake a lane thread for the first
  job. That saves two thread handoffs, most of the cost of a single small get.
* **Native lane loop.** A job of large READs or WRITEs (parts of ``VECTOR_MAX_PART`` and more) runs in the compiled
  :mod:`kvpool.transfer._lanes` where it was built: the same frames, window, checks and deadlines as
  :meth:`_Lane._pipeline`, with the GIL released for the whole job instead of taken back around every
  socket call (decision 0016). Python still builds the frames and verifies the checksums.
* **Zero copy.** WRITE payloads go out with ``sendmsg([frame, memoryview])``; READ payloads are received with
  ``recv_into`` straight into the caller's memoryview. No intermediate bytes objects for payloads.
* **Deadlines** are enforced by kernel socket timeouts (SO_RCVTIMEO / SO_SNDTIMEO on blocking sockets,
  re-armed as the deadline nears): a part not done by the deadline is TIMEOUT and its connection is closed,
  since it may be mid-frame. ``TransferBatch.wait`` cancels what is still running at its deadline (shutting
  down the sockets) and returns only when no lane can touch the caller's buffers any more.

:class:`FrameReader` (a small read-ahead buffer so that a header and a small payload come in one syscall)
and the socket helpers are shared with the store's data-plane server.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.common.auth import MAX_HELLO_REPLY, client_handshake
from kvpool.common.checksum import LazyChecksum, checksum_value
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.grants import GrantOp
from kvpool.common.log import get_logger, log_once
from kvpool.proto.frames import (
    DESC,
    FLAG_REVALIDATE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_VECTOR_ENTRIES,
    VECTOR_COUNT,
    VECTOR_MAX_PART,
    Op,
    vector_codes,
)
from kvpool.transfer.base import Replica, TransferBatch, TransferRequest, Transport

try:
    from kvpool.transfer import _lanes as native_lanes
except ImportError:  # built without a C compiler: the Python loop moves every part
    native_lanes = None  # type: ignore[assignment]

logger = get_logger(__name__)

SOCKET_BUFFER = 4 << 20
READ_AHEAD = 8192
MAX_INFO_BYTES = 16 << 20
# One struct for header + descriptor: a request frame is one pack() plus the key.
_REQUEST = struct.Struct(HEADER.format + DESC.format.lstrip("<@=!>"))
_TIMEVAL = struct.Struct("@ll")
# Replies after which the store closes the connection.
_CLOSING_CODES = frozenset((ErrorCode.TOO_MANY_CONNECTIONS, ErrorCode.BAD_FRAME, ErrorCode.UNKNOWN_OP))
_CLOSING_STATUSES = tuple(int(code) for code in _CLOSING_CODES)
# Single requests up to this size poll for their answer (TcpTransport.spin_s); a larger one takes long
# enough that a wake-up is a small part of it, and polling would take the CPU from the copy.
_SPIN_MAX_BYTES = 256 * 1024


def spin_window(base_s: float, nbytes: int) -> float:
    """How long to poll for the answer to a single request that moves ``nbytes``, or for the request
    that follows such an answer: the base window plus the time those bytes take at ~1 GB/s (the copies
    and the checksum of one small transfer here), up to 4x the base. Past ``_SPIN_MAX_BYTES`` the base:
    the wait is long anyway. Measured: single 64 KiB gets and puts ~10 % faster than with the base alone.
    """
    if nbytes > _SPIN_MAX_BYTES:
        return base_s
    return min(base_s + nbytes * 1e-9, 4 * base_s)


# Request frames (a WRITE's or WRITEV's bytes apart) are at most this long: the window's bound on our send
# buffer relies on it. A READV/WRITEV frame takes only as many entries as fit.
_MAX_FRAME = 4096
_VECTOR_FRAME_BASE = HEADER_SIZE + VECTOR_COUNT.size

# Per-part cost in "bytes" when dealing parts to lanes: a request costs about as much as moving this much.
_PART_OVERHEAD = 32 * 1024


# ------------------------------------------------------------------ socket helpers (shared with the store)
def tune_socket(sock: socket.socket, buffer_bytes: int = SOCKET_BUFFER) -> None:
    """TCP_NODELAY (a request frame must not wait for Nagle) and large buffers (fewer wakeups per MiB)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def set_io_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Kernel send/receive timeouts on a *blocking* socket (None = wait forever).

    Unlike ``settimeout`` (non-blocking fd + poll before every call), the socket stays blocking, so a
    ``recv_into(..., MSG_WAITALL)`` of a whole MiB is one syscall; a timeout shows as BlockingIOError.
    """
    if seconds is None:
        tv = _TIMEVAL.pack(0, 0)
    else:
        micros = max(1, int(seconds * 1e6))  # 0 would mean "forever"
        tv = _TIMEVAL.pack(micros // 1_000_000, micros % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); INVALID_ARGUMENT if malformed."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"bad tcp endpoint {endpoint!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def spin_recv_into(sock: socket.socket, view: memoryview, spin_s: float) -> int:
    """Poll a non-blocking receive for up to ``spin_s``: the bytes received, 0 on EOF, -1 if none came.

    A thread that waits for a small answer by polling instead of sleeping is not woken by the kernel
    when it arrives; on a VM that wake-up is tens of microseconds, a large part of a small call.
    """
    until = time.perf_counter() + spin_s
    while True:
        try:
            return sock.recv_into(view, len(view), socket.MSG_DONTWAIT)
        except BlockingIOError:
            if time.perf_counter() >= until:
                return -1


class Spinner:
    """Receives like a blocking ``recv_into``, but polls first (:func:`spin_recv_into`) while answers
    have been coming within the polling window: a peer that answers slowly, or a connection that sits
    idle, is not polled for, so no CPU is burnt waiting on it (a blocking wait shorter than the window
    turns polling back on)."""

    __slots__ = ("window", "hot")

    def __init__(self, spin_s: float) -> None:
        self.window = spin_s
        self.hot = True

    def recv_into(self, sock: socket.socket, view: memoryview) -> int:
        if self.hot:
            got = spin_recv_into(sock, view, self.window)
            if got >= 0:
                return got
            self.hot = False
        started = time.perf_counter()
        got = sock.recv_into(view, len(view))
        self.hot = time.perf_counter() - started < self.window
        return got


class FrameReader:
    """Buffered reads of frames from a blocking socket.

    Small reads (headers, descriptors) go through a read-ahead buffer, so a header plus a small payload,
    or several pipelined small requests, cost one syscall. Large payloads are received straight into the
    destination (only what was already read ahead, at most ``READ_AHEAD`` bytes, is copied).
    ``before_recv``, if set, runs before every receive syscall (the client re-arms its deadline there).
    ``spinner``, if set, polls for the next bytes before blocking (:class:`Spinner`).
    """

    __slots__ = ("sock", "before_recv", "spinner", "_buf", "_view", "_start", "_end")

    def __init__(
        self, sock: socket.socket, size: int = READ_AHEAD, before_recv: Callable[[], None] | None = None
    ) -> None:
        self.sock = sock
        self.before_recv = before_recv
        self.spinner: Spinner | None = None
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def read(self, n: int) -> memoryview:
        """The next ``n`` (<= buffer size) bytes; valid until the next call. EOF -> CONNECTION_FAILED."""
        if self._end - self._start < n:
            self._fill(n)
        start = self._start
        self._start = start + n
        return self._view[start : start + n]

    def wait_readable(self) -> bool:
        """Block until at least one byte is buffered; False on a clean EOF at a frame boundary."""
        if self._end > self._start:
            return True
        self._start = self._end = 0
        spinner = self.spinner
        if spinner is not None:
            got = spinner.recv_into(self.sock, self._view)
        else:
            got = self.sock.recv_into(self._view, len(self._buf))
        self._end = got
        return got > 0

    def poll(self) -> bool:
        """Whether bytes of a next frame are here already: buffered, or readable now without blocking
        (they are read ahead). False on EOF too; ``wait_readable`` then reports it."""
        if self._end > self._start:
            return True
        self._start = self._end = 0
        try:
            self._end = self.sock.recv_into(self._view, len(self._buf), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        return self._end > 0

    def _fill(self, n: int) -> None:
        if self._start + n > len(self._buf):  # compact: move the unread tail to the front
            tail = self._end - self._start
            self._view[:tail] = self._view[self._start : self._end]
            self._start, self._end = 0, tail
        spinner = self.spinner
        while self._end - self._start < n:
            if self.before_recv is not None:
                self.before_recv()
            if spinner is not None:
                got = spinner.recv_into(self.sock, self._view[self._end :])
            else:
                got = self.sock.recv_into(self._view[self._end :], len(self._buf) - self._end)
            if got == 0:
                raise KvPoolError(ErrorCode.CONNECTION_FAILED, "connection closed by peer")
            self._end += got

    def read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` exactly: read-ahead bytes first, then straight from the socket."""
        take = min(self._end - self._start, len(dest))
        if take:
            dest[:take] = self._view[self._start : self._start + take]
            self._start += take
        recv_all_into(self.sock, dest[take:], self.before_recv)

    def read_into_many(self, dests: list[memoryview]) -> None:
        """Fill each of ``dests`` exactly, in order: read-ahead bytes first, then one scatter receive."""
        i = 0
        while i < len(dests) and self._end > self._start:
            dest = dests[i]
            take = min(self._end - self._start, len(dest))
            dest[:take] = self._view[self._start : self._start + take]
            self._start += take
            if take < len(dest):
                dests = [dest[take:], *dests[i + 1 :]]
                i = 0
                break
            i += 1
        recv_all_into_many(self.sock, dests[i:], self.before_recv)

    def skip(self, n: int, scratch: memoryview) -> None:
        """Consume and discard ``n`` bytes (the payload of a rejected request) through ``scratch``."""
        take = min(self._end - self._start, n)
        self._start += take
        n -= take
        while n > 0:
            chunk = min(n, len(scratch))
            recv_all_into(self.sock, scratch[:chunk], self.before_recv)
            n -= chunk


def recv_all_into(sock: socket.socket, view: memoryview, before: Callable[[], None] | None = None) -> None:
    """``recv_into`` until ``view`` is full (MSG_WAITALL: usually one syscall). EOF -> CONNECTION_FAILED.

    ``before`` runs before each syscall: a receive cut short by the kernel timeout is continued under a
    re-armed (shorter) timeout, so a trickling peer cannot stretch a deadline.
    """
    while view:
        if before is not None:
            before()
        got = sock.recv_into(view, len(view), socket.MSG_WAITALL)
        if got == 0:
            raise KvPoolError(ErrorCode.CONNECTION_FAILED, "connection closed by peer")
        view = view[got:]


def recv_all_into_many(sock: socket.socket, views: list[memoryview], before: Callable[[], None] | None = None) -> None:
    """:func:`recv_all_into` for several buffers in order, with one ``recvmsg_into`` where the bytes are
    there (MSG_WAITALL), looping on short receives."""
    pending = [v for v in views if len(v)]
    while pending:
        if before is not None:
            before()
        got = sock.recvmsg_into(pending, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise KvPoolError(ErrorCode.CONNECTION_FAILED, "connection closed by peer")
        _consume(pending, got)


def send_all(
    sock: socket.socket,
    frame: bytes,
    payload: memoryview | None = None,
    before: Callable[[], None] | None = None,
) -> None:
    """Send ``frame`` then ``payload`` (not copied) with :func:`send_vectored`."""
    send_vectored(sock, [frame] if payload is None else [frame, payload], before)


def send_vectored(sock: socket.socket, buffers: list[Any], before: Callable[[], None] | None = None) -> None:
    """Send byte buffers (bytes, or "B" memoryviews) back to back with one ``sendmsg`` where the kernel
    takes them all, looping on short sends; ``before`` runs before each syscall."""
    pending = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers if len(b)]
    while pending:
        if before is not None:
            before()
        _consume(pending, sock.sendmsg(pending))


def _consume(pending: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of the buffers ``pending`` (what one vectored syscall moved)."""
    done = 0
    while done < len(pending) and n >= len(pending[done]):
        n -= len(pending[done])
        done += 1
    del pending[:done]
    if n:
        pending[0] = pending[0][n:]


_SENDFILE_REFUSED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})


def sendfile_all(sock: socket.socket, fd: int, offset: int, length: int) -> int:
    """Send ``length`` bytes of file ``fd`` from ``offset`` with sendfile, looping on short sends.

    Returns ``length``, or the bytes sent so far (0) when the file refuses sendfile: the caller sends the
    rest another way. A stalled peer shows as BlockingIOError (the socket's kernel send timeout) and a file
    shorter than promised as OSError, as for any send.
    """
    done = 0
    while done < length:
        try:
            n = os.sendfile(sock.fileno(), fd, offset + done, length - done)
        except OSError as exc:
            if done == 0 and exc.errno in _SENDFILE_REFUSED:
                return 0
            raise
        if n <= 0:
            raise OSError(f"file ended {length - done} bytes early")
        done += n
    return done


# ---------------------------------------------------------------------- jobs and batches
class _Broken(Exception):
    """The connection is unusable; every unanswered part of the job gets ``code``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _ReadCheck:
    """Verifies one READ request's bytes once its last part has landed (on the lane that received it)."""

    __slots__ = ("request", "left", "lock")

    def __init__(self, request: TransferRequest, parts: int) -> None:
        self.request = request
        self.left = parts
        self.lock = threading.Lock() if parts > 1 else None

    def landed(self) -> ErrorCode:
        if self.lock is not None:
            with self.lock:
                self.left -= 1
                if self.left:
                    return ErrorCode.OK
        return self.request.check_landed()


def _near_equal_parts(length: int, stripe: int) -> list[int]:
    """The part sizes of a value striped at ``stripe`` bytes: near-equal, so every lane finishes at about the
    same time (the last part is the shorter one)."""
    n_parts = max(1, -(-length // stripe))
    size = -(-length // n_parts)
    return [min(size, length - off) for off in range(0, length, size)] if length else [0]


def _least_loaded(sizes: list[int], loads: list[int]) -> list[int]:
    """Deal parts of ``sizes`` bytes, in order, each to the lane with the least load so far (a part costs
    its bytes plus a request); ``loads`` is updated. The lane index of each part."""
    picks = []
    for n in sizes:
        i = loads.index(min(loads))
        loads[i] += n + _PART_OVERHEAD
        picks.append(i)
    return picks


def _makespan(sizes: list[int], lanes: int) -> int:
    """The busiest lane's cost once ``sizes`` are dealt to ``lanes`` idle lanes as ``_deal`` deals them."""
    loads = [0] * min(lanes, max(1, len(sizes)))
    _least_loaded(sizes, loads)
    return max(loads)


def _source_page(part: _Part) -> int:
    """Where in its 4 KiB page the first byte the store sends for this large READ part lies if the store
    sends it from the segment's pages (sendfile; its reply then says FLAG_FROM_PAGES): at the object's
    offset plus the part's. The compiled loop bounces such a part when its destination would make the
    kernel's copy slow (_lanes.c)."""
    assert part.replica is not None
    return (part.replica.offset + part.part_offset) % 4096


class _Part:
    """One request on the wire: a part of one object (or a control op, with no replica)."""

    __slots__ = ("index", "op", "view", "replica", "key", "checksum", "part_offset", "reply", "check", "flags")

    def __init__(
        self,
        index: int,
        op: Op,
        view: memoryview,
        replica: Replica | None = None,
        key: bytes = b"",
        checksum: int | LazyChecksum = 0,
        part_offset: int = 0,
        check: _ReadCheck | None = None,
        flags: int = 0,
    ) -> None:
        self.index = index  # the request's position in its batch
        self.op = op
        self.view = view  # source (WRITE) / destination (READ) bytes of this part
        self.replica = replica  # where, and the master's grant (mac, expiry) for the whole object
        self.key = key
        self.checksum = checksum  # a LazyChecksum is computed here, on the lane, just before the send
        self.part_offset = part_offset
        self.reply = b""  # STORE_INFO's payload
        self.check = check  # READ with verify: the bytes are checked once the request's last part lands
        self.flags = flags  # the frame header's flags: FLAG_REVALIDATE for a revalidated READ

    def desc_fields(self) -> tuple[int, int, int, int, int, int, int, int, bytes]:
        """The values of this part's DESC (frames.DESC's layout)."""
        r = self.replica
        assert r is not None
        return (
            r.segment_id,
            r.offset,
            r.length,
            r.expiry_ms,
            checksum_value(self.checksum),
            self.part_offset,
            len(self.view),
            len(self.key),
            r.mac,
        )

    def frame(self, req_id: int) -> bytes:
        if self.replica is None:  # control op: a bare header
            return HEADER.pack(MAGIC, self.op, 0, 0, req_id, 0)
        key = self.key
        length = DESC.size + len(key) + (len(self.view) if self.op == Op.WRITE else 0)
        return _REQUEST.pack(MAGIC, self.op, self.flags, 0, req_id, length, *self.desc_fields()) + key


def _vector_frame(req_id: int, parts: list[_Part]) -> bytes:
    """The header and descriptors of one READV/WRITEV frame for ``parts`` (a WRITEV's bytes follow)."""
    entries = b"".join([DESC.pack(*part.desc_fields()) + part.key for part in parts])
    payload = sum(len(part.view) for part in parts) if parts[0].op == Op.WRITE else 0
    return (
        HEADER.pack(
            MAGIC,
            Op.WRITEV if parts[0].op == Op.WRITE else Op.READV,
            # One flag for the whole frame: an entry that did not ask to be revalidated and whose grant
            # ended meanwhile may then be sent, but its reader still refuses it (the lease check).
            FLAG_REVALIDATE if any(part.flags for part in parts) else 0,
            0,
            req_id,
            VECTOR_COUNT.size + len(entries) + payload,
        )
        + VECTOR_COUNT.pack(len(parts))
        + entries
    )


class _Solo:
    """The "batch" of a lone single-part request that its caller moves itself on an idle lane."""

    __slots__ = ("deadline", "cancelled")

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.cancelled = False  # nobody else can cancel it: the caller is the one waiting

    def job_done(self, job: _Job) -> None:
        """Nothing to merge: the caller reads ``job.codes`` itself."""


class _Job:
    """The parts of one batch that one lane moves, in order."""

    __slots__ = ("batch", "parts", "codes", "done", "cost")

    def __init__(self, batch: _Batch | _Solo, parts: list[_Part], cost: int = 0) -> None:
        self.batch = batch
        self.parts = parts
        self.codes: list[ErrorCode] = []
        self.done = 0  # parts [0, done) are answered
        self.cost = cost  # what it adds to its lane's load while queued or running

    def fail_rest(self, code: ErrorCode) -> None:
        self.codes.extend([code] * (len(self.parts) - len(self.codes)))
        self.done = len(self.parts)


class _Batch(TransferBatch):
    """Per-request codes of one submitted batch; a request is OK only if all its parts are.

    Completion is a plain lock held until the last job is done (a threading.Event costs ~5 us to create
    and ~10 us to set and wait on: a tenth of a small get).
    """

    def __init__(self, n_requests: int, deadline: Deadline) -> None:
        self.codes: list[ErrorCode] = [ErrorCode.OK] * n_requests
        self.deadline = deadline
        self.cancelled = False
        self._lock = threading.Lock()
        self._latch = threading.Lock()
        self._latch.acquire()
        self._finished = False
        self._pending = 0
        self._jobs: list[tuple[_Lane, _Job]] = []

    def add_job(self, lane: _Lane, job: _Job) -> None:
        self._pending += 1
        self._jobs.append((lane, job))

    def seal(self) -> None:
        """All jobs are added; a batch with none is done already."""
        if self._pending == 0:
            self._finished = True
            self._latch.release()

    def job_done(self, job: _Job) -> None:
        with self._lock:
            if any(job.codes):  # ErrorCode.OK is 0: only failures need merging
                codes = self.codes
                for part, code in zip(job.parts, job.codes, strict=True):
                    if code and not codes[part.index]:
                        codes[part.index] = code
            self._pending -= 1
            if self._pending == 0:
                self._finished = True
                self._latch.release()

    def _wait_finished(self, timeout: float | None) -> bool:
        if self._finished:
            return True
        if not self._latch.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._latch.release()  # let any other waiter through too
        return True

    def wait(self, deadline: Deadline) -> list[ErrorCode]:
        if not self._finished and _not_sooner(deadline, self.deadline):
            for lane, job in self._jobs:  # help: run jobs no lane thread has picked up yet
                lane.run_inline(job)
        if not self._wait_finished(_min_remaining(deadline, self.deadline)):
            self.cancel()
            self._wait_finished(None)  # lanes give up promptly once their sockets are shut down
        return list(self.codes)

    def cancel(self) -> None:
        """Stop every job of this batch; unanswered parts become TIMEOUT."""
        self.cancelled = True
        for lane, job in self._jobs:
            lane.cancel(job)


def _not_sooner(a: Deadline, b: Deadline) -> bool:
    """Whether ``a`` ends no sooner than ``b`` (running b's work inline cannot overrun a)."""
    return a.at is None or (b.at is not None and b.at <= a.at)


def _min_remaining(a: Deadline, b: Deadline) -> float | None:
    ra, rb = a.remaining(), b.remaining()
    if ra is None:
        return rb
    return ra if rb is None else min(ra, rb)


# ---------------------------------------------------------------------- lanes and endpoints
class _Lane:
    """One persistent connection to an endpoint and the thread that drives it."""

    def __init__(self, transport: TcpTransport, endpoint: _Endpoint, index: int) -> None:
        self._t = transport
        self._ep = endpoint
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._current: _Job | None = None
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._armed: float | None = None  # the io timeout last set on the socket
        self._at: float | None = None  # the running job's deadline (monotonic), for _rearm
        self._window = 1  # requests in flight, and their payload bytes: set per connection
        self._max_inflight = 1
        self._req_id = 0
        self._spinner = Spinner(transport.spin_s) if transport.spin_s else None
        self._polls = False  # whether the running job polls for answers (single small requests only)
        self._vectored = False  # whether this connection's store takes READV/WRITEV (probed at connect)
        self._closed = False
        self.load = 0  # bytes assigned and not yet moved (approximate; for dealing parts)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kvpool-tcp-{endpoint.name}-{index}")
        self._thread.start()

    # ---- called by other threads
    def enqueue(self, job: _Job, announce: bool = True) -> None:
        """Queue ``job``; ``announce`` wakes the lane thread (else the caller promises to ``run_inline``)."""
        with self._cond:
            if not self._closed:
                self._jobs.append(job)
                self.load += job.cost
                if announce:
                    self._cond.notify()
                return
        job.fail_rest(ErrorCode.SHUTTING_DOWN)
        job.batch.job_done(job)

    @property
    def idle(self) -> bool:
        """Nothing queued or running (read without the lock: a hint for placing a small request)."""
        return self._current is None and not self._jobs

    def cancel(self, job: _Job) -> None:
        with self._cond:
            queued = job in self._jobs
            if queued:
                self._jobs.remove(job)
                self.load -= job.cost
            elif self._current is job and self._sock is not None:
                _shutdown(self._sock)  # wakes the lane from any blocking call on it
        if queued:
            job.fail_rest(ErrorCode.TIMEOUT)
            job.batch.job_done(job)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            jobs, self._jobs = list(self._jobs), deque()
            self.load = 0
            if self._sock is not None:
                _shutdown(self._sock)
            self._cond.notify()
        for job in jobs:
            job.fail_rest(ErrorCode.SHUTTING_DOWN)
            job.batch.job_done(job)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # ---- the lane's own thread
    def run_inline(self, job: _Job) -> None:
        """Run ``job`` on the calling thread if no lane thread has started it and the lane is idle.

        ``wait`` calls this: the waiting thread is blocked anyway, and doing the work itself saves two
        thread handoffs (wake the lane, wake the waiter) - most of the latency of a single small get.
        """
        with self._cond:
            if self._current is not None or self._closed or job not in self._jobs:
                return
            self._jobs.remove(job)
            self._current = job
        self._execute(job)

    def run_solo(self, part: _Part, deadline: Deadline) -> ErrorCode | None:
        """Move one part on the calling thread if this lane is idle; None if it was taken meanwhile."""
        job = _Job(_Solo(deadline), [part])
        with self._cond:
            if self._current is not None or self._jobs or self._closed:
                return None
            self._current = job
        self._polls = len(part.view) <= _SPIN_MAX_BYTES
        if self._polls and self._spinner is not None:
            self._spinner.window = spin_window(self._t.spin_s, len(part.view))
        try:
            self._execute(job)
        finally:
            self._polls = False
        return job.codes[0]

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._jobs or self._current is not None) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
                job = self._current = self._jobs.popleft()
            self._execute(job)
        with self._cond:
            busy = self._current is not None
        if not busy:  # else the thread running a job inline closes the socket when it is done
            self._discard()

    def _execute(self, job: _Job) -> None:
        """Run a job that this thread has claimed (``_current``), then hand the lane back."""
        try:
            self._run_job(job)
        except Exception:  # a bug must fail the job, never hang the caller
            logger.exception("tcp lane %s: unexpected error", self._ep.name)
            self._discard()
            job.fail_rest(ErrorCode.INTERNAL)
        with self._cond:
            self._current = None
            closed = self._closed
            self.load -= job.cost
            if self._jobs:
                self._cond.notify()  # the lane thread may have slept while another thread ran a job
        if closed:
            self._discard()
        job.batch.job_done(job)

    def _run_job(self, job: _Job) -> None:
        batch = job.batch
        retried = False
        while job.done < len(job.parts):
            if batch.cancelled or batch.deadline.expired():
                job.fail_rest(ErrorCode.TIMEOUT)
                return
            reused = self._sock is not None
            self._at = batch.deadline.at  # what _rearm keeps the socket timeouts within
            try:
                self._connect(batch.deadline)
                self._pipeline(job)
            except _Broken as exc:
                self._discard()
                code = ErrorCode.TIMEOUT if batch.cancelled else exc.code
                # A pooled connection may have died while idle (store restarted): every op is idempotent,
                # so the unanswered parts are retried once on a fresh connection.
                if code == ErrorCode.CONNECTION_FAILED and reused and not retried:
                    retried = True
                    continue
                if code not in (ErrorCode.TIMEOUT, ErrorCode.CONNECTION_FAILED):
                    logger.warning("tcp %s: %s (%s)", self._ep.name, code.name, exc)
                job.fail_rest(code)

    def _connect(self, deadline: Deadline) -> None:
        if self._sock is not None:
            return
        self._open(deadline)
        if self._t.vector_bytes and not self._probe_vectored(deadline):
            self._discard()  # a store refuses an unknown op by closing the connection
            self._open(deadline)
        self._ep.connected()

    def _open(self, deadline: Deadline) -> None:
        """A fresh connection: connected, tuned, the token presented, the window sized."""
        self._ep.check_cooldown()
        remaining = deadline.remaining()
        timeout = self._t.connect_timeout if remaining is None else min(self._t.connect_timeout, remaining)
        try:
            sock = socket.create_connection(self._ep.address, timeout=max(timeout, 0.001))
        except OSError as exc:
            self._ep.connect_failed()
            code = ErrorCode.TIMEOUT if deadline.expired() else ErrorCode.CONNECTION_FAILED
            raise _Broken(code, f"connect to {self._ep.name}: {exc}") from None
        try:
            sock.settimeout(None)  # blocking: deadlines are kernel timeouts (set_io_timeout)
            tune_socket(sock, self._t.socket_buffer)
        except OSError as exc:
            sock.close()
            raise _Broken(ErrorCode.CONNECTION_FAILED, f"setsockopt: {exc}") from None
        with self._cond:
            if self._closed:
                sock.close()
                raise _Broken(ErrorCode.SHUTTING_DOWN, "transport closed")
            self._sock = sock
            if self._current is not None and self._current.batch.cancelled:
                # cancel() ran while we were connecting and had no socket to shut down
                raise _Broken(ErrorCode.TIMEOUT, "batch cancelled")
        self._reader = FrameReader(sock, before_recv=self._rearm)
        self._armed = None
        self._vectored = False
        if self._t.token:
            self._hello(deadline)
        self._bound_window(sock)

    def _exchange(self, frame: bytes, what: str, deadline: Deadline) -> tuple[int, int, int, int]:
        """Send one handshake frame on the fresh connection and read its reply's (magic, op, status, length)."""
        sock, reader = self._sock_or_raise(), self._reader
        assert reader is not None
        try:
            self._arm(deadline.at)
            sock.sendall(frame)
            magic, op, _flags, status, _rid, length = HEADER.unpack(reader.read(HEADER_SIZE))
        except BlockingIOError:
            raise _Broken(ErrorCode.TIMEOUT, f"{what} to {self._ep.name}: deadline passed") from None
        except KvPoolError as exc:
            raise _Broken(exc.code, f"{what} to {self._ep.name}: {exc.message}") from None
        except OSError as exc:
            raise _Broken(ErrorCode.CONNECTION_FAILED, f"{what} to {self._ep.name}: {exc}") from None
        return magic, op, status, length

    def _hello(self, deadline: Deadline) -> None:
        """Prove the cluster token (challenge-response, common/auth.py): first on every connection when set."""
        reader = self._reader
        assert reader is not None

        def exchange(body: bytes) -> tuple[int, bytes]:
            frame = HEADER.pack(MAGIC, Op.HELLO, 0, 0, 0, len(body)) + body
            magic, op, status, length = self._exchange(frame, "HELLO", deadline)
            if magic != MAGIC or op != Op.HELLO or length > MAX_HELLO_REPLY:
                raise _Broken(ErrorCode.BAD_FRAME, f"bad HELLO reply from {self._ep.name}")
            try:
                return status, bytes(reader.read(length)) if length else b""
            except BlockingIOError:
                raise _Broken(ErrorCode.TIMEOUT, f"HELLO to {self._ep.name}: deadline passed") from None
            except KvPoolError as exc:
                raise _Broken(exc.code, f"HELLO to {self._ep.name}: {exc.message}") from None
            except OSError as exc:
                raise _Broken(ErrorCode.CONNECTION_FAILED, f"HELLO to {self._ep.name}: {exc}") from None

        try:
            client_handshake(self._t.token, exchange, f"store {self._ep.name}")
        except KvPoolError as exc:
            raise _Broken(exc.code, exc.message) from None

    def _probe_vectored(self, deadline: Deadline) -> bool:
        """Whether the store takes READV/WRITEV: an empty READV is answered OK by one that does, and
        UNKNOWN_OP (then the connection is closed) by one that predates them."""
        frame = HEADER.pack(MAGIC, Op.READV, 0, 0, 0, VECTOR_COUNT.size) + VECTOR_COUNT.pack(0)
        magic, op, status, length = self._exchange(frame, "READV probe", deadline)
        if magic != MAGIC or length:
            raise _Broken(ErrorCode.BAD_FRAME, f"bad READV probe reply from {self._ep.name}")
        if status == ErrorCode.UNKNOWN_OP:
            self._ep.no_vectored_ops()
            return False
        if status != 0:  # the store refused the connection itself (too many, no token): the store says why
            raise _Broken(as_code(status), f"store {self._ep.name} refused the connection")
        if op != Op.READV:
            raise _Broken(ErrorCode.BAD_FRAME, f"bad READV probe reply from {self._ep.name}")
        self._vectored = True
        return True

    def _bound_window(self, sock: socket.socket) -> None:
        """Size the pipeline to this connection's real buffers (the kernel may grant less than asked).

        Either bound alone rules out the deadlock of the module docstring: responses in flight fit in our
        receive buffer (so the store never blocks sending), and request frames in flight fit in our send
        buffer (so we never block sending): a request frame is at most ``_MAX_FRAME`` bytes.
        """
        rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        self._max_inflight = max(1, min(self._t.inflight_bytes, rcvbuf // 2))
        self._window = max(1, min(self._t.window, sndbuf // _MAX_FRAME))

    def _discard(self) -> None:
        with self._cond:
            sock, self._sock = self._sock, None
        self._reader = None
        if sock is not None:
            sock.close()

    def _arm(self, at: float | None) -> None:
        """Keep the socket's kernel timeout within a little of the time left until ``at`` (monotonic)."""
        armed = self._armed
        if at is None:
            if armed is not None:
                set_io_timeout(self._sock_or_raise(), None)
                self._armed = None
            return
        remaining = at - time.monotonic()
        if remaining <= 0:
            raise _Broken(ErrorCode.TIMEOUT, "deadline passed")
        # Re-arm when the last timeout would overshoot the deadline by more than 10% (or 2 ms): a
        # setsockopt per request would cost more than the check.
        if armed is None or armed - remaining > max(0.002, 0.1 * remaining):
            set_io_timeout(self._sock_or_raise(), remaining)
            self._armed = remaining

    def _rearm(self) -> None:
        """Before every blocking syscall: a call cut short by the timeout continues under a shorter one."""
        self._arm(self._at)

    def _sock_or_raise(self) -> socket.socket:
        sock = self._sock
        if sock is None:
            raise _Broken(ErrorCode.CONNECTION_FAILED, "not connected")
        return sock

    def _pipeline(self, job: _Job) -> None:
        """Send up to ``window`` frames ahead and read responses in order, until the job is answered.
        Small READ (WRITE) parts next to each other go several to a READV (WRITEV) frame."""
        sock = self._sock_or_raise()
        reader = self._reader
        assert reader is not None
        reader.spinner = self._spinner if self._polls else None
        parts = job.parts
        window = self._window
        max_bytes = self._max_inflight
        inflight: deque[tuple[int, list[_Part], int]] = deque()  # (req_id, the parts its frame moves, bytes)
        inflight_bytes = 0
        next_send = job.done
        refill_at = window // 2
        try:
            if self._t.native_lanes and self._native_job(job, sock, reader):
                return
            if len(parts) - job.done == 1:  # one request: no window to keep (a single get or put)
                part = parts[job.done]
                self._req_id += 1
                send_all(sock, part.frame(self._req_id), part.view if part.op == Op.WRITE else None, self._rearm)
                self._answered(job, reader, self._req_id, [part])
                return
            while job.done < len(parts):
                if job.batch.cancelled:
                    raise _Broken(ErrorCode.TIMEOUT, "batch cancelled")
                # READ frames are tiny: refill only once half the window is answered, with one vectored
                # send, so a burst of reads costs us one syscall and the store one wake-up, not one per
                # request. A WRITE carries its payload and goes as soon as there is room (holding writes
                # back for a burst measured no faster).
                if next_send < len(parts) and (len(inflight) <= refill_at or parts[next_send].op != Op.READ):
                    out: list[Any] = []
                    while next_send < len(parts) and len(inflight) < window:
                        part = parts[next_send]
                        if inflight and (
                            inflight[0][1][0].op != part.op  # one direction at a time (docstring)
                            or inflight_bytes + len(part.view) > max_bytes
                        ):
                            break
                        self._req_id += 1
                        group = self._group(parts, next_send, max_bytes - inflight_bytes)
                        if len(group) > 1:
                            out.append(_vector_frame(self._req_id, group))
                            if part.op == Op.WRITE:
                                out.extend(p.view for p in group)
                        else:
                            out.append(part.frame(self._req_id))
                            if part.op == Op.WRITE:
                                out.append(part.view)
                        nbytes = sum(len(p.view) for p in group)
                        inflight.append((self._req_id, group, nbytes))
                        inflight_bytes += nbytes
                        next_send += len(group)
                    send_vectored(sock, out, self._rearm)
                req_id, group, nbytes = inflight.popleft()
                inflight_bytes -= nbytes
                self._answered(job, reader, req_id, group)
        except BlockingIOError:
            raise _Broken(ErrorCode.TIMEOUT, "deadline passed mid-transfer") from None
        except KvPoolError as exc:
            raise _Broken(exc.code, exc.message) from None
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise _Broken(ErrorCode.TIMEOUT, "deadline passed mid-transfer") from None
            raise _Broken(ErrorCode.CONNECTION_FAILED, str(exc)) from None

    def _native_job(self, job: _Job, sock: socket.socket, reader: FrameReader) -> bool:
        """Run the rest of ``job`` in the compiled loop (module docstring) if it is all large READs or all
        large WRITEs and nothing is read ahead; False leaves it to the Python loop."""
        parts = job.parts[job.done :]
        op = parts[0].op
        if reader.buffered or self._polls or op not in (Op.READ, Op.WRITE):
            return False
        if any(p.op != op or len(p.view) < VECTOR_MAX_PART for p in parts):
            return False
        first = self._req_id + 1
        frames = [part.frame(first + i) for i, part in enumerate(parts)]  # computes WRITE checksums
        self._req_id += len(parts)
        self._rearm()  # also clears a timeout left from an earlier job when this one has no deadline
        statuses, outcome, reply_op, message, self._armed = native_lanes.pipeline(
            sock.fileno(),
            frames,
            [part.view for part in parts],
            first,
            self._window,
            self._max_inflight,
            self._at,
            self._armed,
            op,
            Op.WRITE,
            _CLOSING_STATUSES,
            None if op == Op.WRITE else [_source_page(part) for part in parts],
        )
        stop = statuses.pop() if outcome == native_lanes.STOPPED else None
        codes = [ErrorCode.OK if status == 0 else as_code(status) for status in statuses]
        self._record(job, parts[: len(codes)], codes)  # the answered parts: a prefix
        if outcome != native_lanes.DONE:
            raise self._native_failure(outcome, stop, reply_op, message)
        return True

    def _native_failure(self, outcome: int, stop: int | None, reply_op: int, message: str) -> _Broken:
        """The _Broken that the Python loop raises for the same reply or socket error."""
        if stop is not None:
            code = as_code(stop)
            return self._closing_reply(code, reply_op) or _Broken(
                ErrorCode.BAD_FRAME, f"{code.name} in an op {reply_op} reply ({self._ep.name})"
            )
        if outcome == native_lanes.TIMED_OUT:
            return _Broken(ErrorCode.TIMEOUT, message)
        if outcome == native_lanes.BAD_FRAME:
            return _Broken(ErrorCode.BAD_FRAME, f"{message} from {self._ep.name}")
        return _Broken(ErrorCode.CONNECTION_FAILED, message)

    def _group(self, parts: list[_Part], first: int, room: int) -> list[_Part]:
        """The parts from ``first`` that one frame moves: a run of small READs or small WRITEs (at most
        ``vector_bytes`` and ``room`` bytes together) when the store takes READV/WRITEV, else
        ``parts[first]`` alone."""
        part = parts[first]
        op = part.op
        if op not in (Op.READ, Op.WRITE) or len(part.view) >= VECTOR_MAX_PART or not self._vectored:
            return [part]
        room = min(room, self._t.vector_bytes)
        group = [part]
        nbytes = len(part.view)
        frame_bytes = _VECTOR_FRAME_BASE + DESC.size + len(part.key)
        for i in range(first + 1, min(len(parts), first + MAX_VECTOR_ENTRIES)):
            part = parts[i]
            nbytes += len(part.view)
            frame_bytes += DESC.size + len(part.key)
            if part.op != op or len(part.view) >= VECTOR_MAX_PART or nbytes > room or frame_bytes > _MAX_FRAME:
                break
            group.append(part)
        return group

    def _answered(self, job: _Job, reader: FrameReader, req_id: int, group: list[_Part]) -> None:
        """Read the answer to the frame of ``group`` (verified, for READs that asked) into the job's codes."""
        if len(group) == 1:
            codes = [self._receive(reader, req_id, group[0])]
        else:
            codes = self._receive_vector(reader, req_id, group)
        self._record(job, group, codes)

    @staticmethod
    def _record(job: _Job, parts: list[_Part], codes: list[ErrorCode]) -> None:
        """The codes of answered ``parts`` into the job, each READ that asked for it verified as it lands."""
        for part, code in zip(parts, codes, strict=True):
            if part.check is not None and code == ErrorCode.OK:
                code = part.check.landed()
            job.codes.append(code)
        job.done += len(parts)

    def _closing_reply(self, code: ErrorCode, reply_op: int) -> _Broken | None:
        """The _Broken for a reply after which the store closes the connection, or None."""
        if reply_op == Op.HELLO and code in (ErrorCode.AUTH_FAILED, ErrorCode.AUTH_VERSION_MISMATCH):  # no token
            return _Broken(code, f"store {self._ep.name} requires the cluster token")
        if code in _CLOSING_CODES:
            return _Broken(code, f"store {self._ep.name} closed the connection: {code.name}")
        return None

    def _reply_code(self, reader: FrameReader, req_id: int) -> tuple[ErrorCode, int]:
        """A reply's header for the frame ``req_id``: its code and payload length. Raises _Broken for a
        reply after which the connection cannot go on."""
        magic, reply_op, _flags, status, rid, length = HEADER.unpack(reader.read(HEADER_SIZE))
        if magic != MAGIC:
            raise _Broken(ErrorCode.BAD_FRAME, f"bad magic 0x{magic:08x} from {self._ep.name}")
        code = ErrorCode.OK if status == 0 else as_code(status)
        if (closing := self._closing_reply(code, reply_op)) is not None:
            raise closing
        if rid != req_id:
            raise _Broken(ErrorCode.BAD_FRAME, f"response {rid} for request {req_id} from {self._ep.name}")
        return code, length

    def _receive_vector(self, reader: FrameReader, req_id: int, group: list[_Part]) -> list[ErrorCode]:
        """The answer to a READV/WRITEV: a code per entry, then (READV) the bytes of the OK entries."""
        op = Op.READV if group[0].op == Op.READ else Op.WRITEV
        code, length = self._reply_code(reader, req_id)
        if code != ErrorCode.OK:
            if length:
                raise _Broken(ErrorCode.BAD_FRAME, f"a {length}-byte payload in a failed {op.name} reply")
            return [code] * len(group)
        table = vector_codes(len(group))
        if length < table.size:
            raise _Broken(ErrorCode.BAD_FRAME, f"{op.name} of {len(group)} answered with {length} bytes")
        codes = [ErrorCode.OK if c == 0 else as_code(c) for c in table.unpack(reader.read(table.size))]
        dests = [p.view for p, c in zip(group, codes, strict=True) if c == ErrorCode.OK] if op == Op.READV else []
        if length != table.size + sum(len(d) for d in dests):
            raise _Broken(ErrorCode.BAD_FRAME, f"{op.name} answered with {length} bytes, not what its codes say")
        reader.read_into_many(dests)
        return codes

    def _receive(self, reader: FrameReader, req_id: int, part: _Part) -> ErrorCode:
        code, length = self._reply_code(reader, req_id)
        if code == ErrorCode.OK and part.op == Op.READ:
            if length != len(part.view):
                raise _Broken(ErrorCode.BAD_FRAME, f"READ answered with {length} bytes, {len(part.view)} asked")
            reader.read_into(part.view)
        elif code == ErrorCode.OK and part.op == Op.STORE_INFO:
            if length > MAX_INFO_BYTES:
                raise _Broken(ErrorCode.BAD_FRAME, f"STORE_INFO of {length} bytes")
            reply = bytearray(length)
            reader.read_into(memoryview(reply))
            part.reply = bytes(reply)
        elif length:
            raise _Broken(ErrorCode.BAD_FRAME, f"unexpected {length}-byte payload in a {part.op.name} reply")
        return code


class _Endpoint:
    """The lanes to one store endpoint, and its reconnect cooldown."""

    def __init__(self, transport: TcpTransport, name: str) -> None:
        self._t = transport
        self.name = name
        self.address = parse_endpoint(name)
        self._lanes: list[_Lane] = []
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._rr = 0
        self._closed = False
        self._told_unvectored = False

    def lanes_for(self, n_parts: int) -> list[_Lane]:
        """The lanes a batch may use: all of them for as many parts as lanes; for fewer parts, idle lanes
        first, in turn (a small request should not queue behind a large one), then the least loaded.
        Lanes (a thread and a connection each) are created on first use only."""
        count = self._t.connections_per_endpoint
        lanes = self._lanes
        if n_parts >= count:
            if len(lanes) < count:
                self._create(count)
            return self._lanes
        start = self._rr  # unlocked round robin: a race only changes which idle lane is picked
        self._rr = start + 1
        picked: list[_Lane] = []
        for i in range(len(lanes)):
            lane = lanes[(start + i) % len(lanes)]
            if lane.idle:
                picked.append(lane)
                if len(picked) == n_parts:
                    return picked
        if len(lanes) < count:  # a new lane is idle too
            self._create(min(count, len(lanes) + n_parts - len(picked)))
            picked += self._lanes[len(lanes) :]
        if len(picked) < n_parts:  # every lane is busy: the least loaded
            picked += sorted((lane for lane in self._lanes if lane not in picked), key=lambda lane: lane.load)[
                : n_parts - len(picked)
            ]
        return picked[:n_parts]

    def first_idle_lane(self) -> _Lane | None:
        """The first idle lane (always the same one while requests come one at a time: its connection
        and the store thread serving it stay warm); creates the first lane on first use."""
        if not self._lanes:
            self._create(1)
        for lane in self._lanes:
            if lane.idle:
                return lane
        return None

    def _create(self, count: int) -> None:
        with self._lock:
            if self._closed:
                raise KvPoolError(ErrorCode.SHUTTING_DOWN, "transport closed")
            lanes = list(self._lanes)
            while len(lanes) < count:
                lanes.append(_Lane(self._t, self, len(lanes)))
            self._lanes = lanes  # replaced whole: readers never see a half-built list

    def close(self) -> list[_Lane]:
        """Close every lane (no new ones after this); returns them, for joining."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes)
        for lane in lanes:
            lane.close()
        return lanes

    def no_vectored_ops(self) -> None:
        """A connection found the store without READV/WRITEV: said once per endpoint."""
        if not self._told_unvectored:
            self._told_unvectored = True
            logger.warning(
                "tcp %s: the store does not know READV/WRITEV (an older kvpool); sending plain READs and WRITEs",
                self.name,
            )

    def check_cooldown(self) -> None:
        if time.monotonic() < self._down_until:
            raise _Broken(ErrorCode.CONNECTION_FAILED, f"{self.name} unreachable (reconnect cooldown)")

    def connect_failed(self) -> None:
        self._down_until = time.monotonic() + self._t.reconnect_cooldown_s

    def connected(self) -> None:
        self._down_until = 0.0


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or never connected


# ---------------------------------------------------------------------- the transport
def native_available() -> bool:
    """Whether the compiled lane loop was built; logs once per process when it was not."""
    if native_lanes is None:
        log_once(
            logger,
            logging.WARNING,
            "tcp-native-lanes",
            "kvpool.transfer._lanes was not built (no C compiler or Python headers at install): large TCP "
            "reads and writes use the Python loop",
        )
    return native_lanes is not None


class TcpTransport(Transport):
    """READ/WRITE of object ranges on stores over pooled, pipelined, striped TCP connections."""

    name = "tcp"
    verifies_reads = True
    revalidates_reads = True

    def __init__(
        self,
        connections_per_endpoint: int = 4,
        stripe_bytes: int = 1 << 20,
        connect_timeout: float = 2.0,
        window: int = 16,
        socket_buffer: int = SOCKET_BUFFER,
        reconnect_cooldown_s: float = 1.0,
        inflight_bytes: int | None = None,
        token: bytes = b"",
        spin_us: int = 0,
        vector_bytes: int = 512 << 10,
        native_lanes: bool = True,
    ) -> None:
        if connections_per_endpoint < 1 or stripe_bytes < 1 or window < 1 or vector_bytes < 0:
            raise KvPoolError(
                ErrorCode.INVALID_ARGUMENT,
                "connections_per_endpoint, stripe_bytes and window must be >= 1, vector_bytes >= 0",
            )
        self.window = window
        # Payload bytes a lane keeps in flight. Past about two parts more only adds data sitting cold in
        # socket buffers (measured: a deeper pipeline is slower on loopback, as it leaves the CPU caches).
        self.inflight_bytes = max(2 << 20, 2 * stripe_bytes) if inflight_bytes is None else inflight_bytes
        self.connections_per_endpoint = connections_per_endpoint
        self.stripe_bytes = stripe_bytes
        self.connect_timeout = connect_timeout
        self.socket_buffer = socket_buffer
        self.reconnect_cooldown_s = reconnect_cooldown_s
        self.token = token
        """The cluster token, proved (never sent) by a challenge-response first on every new connection when set."""
        self.spin_s = spin_us / 1e6
        """A single small request polls this long for its answer before it blocks."""
        self.vector_bytes = vector_bytes
        """Payload bytes one READV/WRITEV frame moves at most (0: one READ or WRITE per part)."""
        self.native_lanes = native_lanes and native_available()
        """Whether jobs of large READs and WRITEs run in the compiled loop (module docstring)."""
        self._lock = threading.Lock()
        self._endpoints: dict[str, _Endpoint] = {}
        self._closed = False

    # ---- Transport
    def submit(self, requests: Sequence[TransferRequest], deadline: Deadline) -> TransferBatch:
        return self._submit(requests, deadline, caller_waits=False)

    def transfer(self, requests: Sequence[TransferRequest], deadline: Deadline) -> list[ErrorCode]:
        """``submit`` + ``wait``, with the calling thread moving one job itself instead of waking a lane
        thread for it (it would block in ``wait`` anyway; docs/decisions/0050-measurements.md). A lone
        single-part request (a single get) skips the batch machinery altogether when a lane is idle."""
        if len(requests) == 1:
            code = self._transfer_one(requests[0], deadline)
            if code is not None:
                return [code]
        return self._submit(requests, deadline, caller_waits=True).wait(deadline)

    def _transfer_one(self, req: TransferRequest, deadline: Deadline) -> ErrorCode | None:
        """Move one request on the calling thread over an idle lane; None if it needs the batch path."""
        if req.replica.length > self.stripe_bytes:
            return None  # striped: the batch path deals its parts over the lanes (and splits it once)
        parts = self._split(0, req)
        if isinstance(parts, ErrorCode):
            return parts
        try:
            endpoint = self._endpoint(req.replica.tcp_endpoint)
        except KvPoolError as exc:
            return exc.code
        lane = endpoint.first_idle_lane()
        return None if lane is None else lane.run_solo(parts[0], deadline)

    def _submit(self, requests: Sequence[TransferRequest], deadline: Deadline, caller_waits: bool) -> _Batch:
        batch = _Batch(len(requests), deadline)
        by_endpoint: dict[str, list[int]] = {}
        for index, req in enumerate(requests):
            by_endpoint.setdefault(req.replica.tcp_endpoint, []).append(index)
        plan: list[tuple[_Lane, _Job]] = []
        for name, indexes in by_endpoint.items():
            stripe = self._stripes_help([requests[i].replica.length for i in indexes])
            parts: list[_Part] = []
            for index in indexes:
                split = self._split(index, requests[index], stripe)
                if isinstance(split, ErrorCode):
                    batch.codes[index] = split
                else:
                    parts.extend(split)
            if not parts:
                continue
            try:
                plan.extend(self._deal(batch, self._endpoint(name), parts))
            except KvPoolError as exc:  # a malformed endpoint, or the transport is closing
                for part in parts:
                    batch.codes[part.index] = exc.code
        # Every job is counted before any starts, so the batch cannot look finished early.
        for lane, job in plan:
            batch.add_job(lane, job)
        batch.seal()
        for i, (lane, job) in enumerate(plan):
            # A job left unannounced is still always run: by the waiter (run_inline) if the lane is idle,
            # else by whoever is running the lane now, which looks at the queue when it finishes.
            lane.enqueue(job, announce=i > 0 or not caller_waits)
        return batch

    def close(self) -> None:
        with self._lock:
            self._closed = True
            endpoints, self._endpoints = list(self._endpoints.values()), {}
        lanes = [lane for ep in endpoints for lane in ep.close()]
        for lane in lanes:
            lane.join(5.0)

    # ---- control ops
    def ping(self, endpoint: str, deadline: Deadline) -> ErrorCode:
        """Round-trip a PING to a store over a pooled connection; OK or the failure's code."""
        code, _ = self._control(endpoint, Op.PING, deadline)
        return code

    def store_info(self, endpoint: str, deadline: Deadline) -> dict[str, Any]:
        """The store's self-description (JSON); raises KvPoolError with the failure's code."""
        code, reply = self._control(endpoint, Op.STORE_INFO, deadline)
        if code != ErrorCode.OK:
            raise KvPoolError(code, f"STORE_INFO from {endpoint}")
        try:
            info = json.loads(reply)
        except ValueError as exc:
            raise KvPoolError(ErrorCode.BAD_FRAME, f"STORE_INFO from {endpoint} is not JSON") from exc
        if not isinstance(info, dict):
            raise KvPoolError(ErrorCode.BAD_FRAME, f"STORE_INFO from {endpoint} is not an object")
        return info

    def _control(self, name: str, op: Op, deadline: Deadline) -> tuple[ErrorCode, bytes]:
        batch = _Batch(1, deadline)
        part = _Part(0, op, memoryview(b""))
        job = _Job(batch, [part])
        try:
            lane = self._endpoint(name).lanes_for(1)[0]
        except KvPoolError as exc:
            return exc.code, b""
        batch.add_job(lane, job)
        batch.seal()
        lane.enqueue(job, announce=False)  # wait() runs it (or the lane's current runner does)
        return batch.wait(deadline)[0], part.reply

    # ---- planning
    def _endpoint(self, name: str) -> _Endpoint:
        endpoint = self._endpoints.get(name)  # the common case, without the lock
        if endpoint is not None and not self._closed:
            return endpoint
        with self._lock:
            if self._closed:
                raise KvPoolError(ErrorCode.SHUTTING_DOWN, "transport closed")
            endpoint = self._endpoints.get(name)
            if endpoint is None:
                endpoint = self._endpoints[name] = _Endpoint(self, name)
            return endpoint

    def _stripes_help(self, lengths: list[int]) -> bool:
        """Whether the values of one endpoint's share of a batch are striped (module docstring, "Parts").

        Striping spreads a large value over the lanes; when a batch holds enough of them to keep every lane
        busy whole, each extra part only costs a request (batched 4 MiB gets and puts measured 5-10 %
        faster unstriped). So the values go whole unless striping finishes sooner, by the dealing's own
        cost model: 5 values of 4 MiB on 4 lanes are striped, 8 go whole."""
        stripe = self.stripe_bytes
        if all(n <= stripe for n in lengths):
            return False
        lanes = self.connections_per_endpoint
        striped = [part for n in lengths for part in _near_equal_parts(n, stripe)]
        return _makespan(striped, lanes) < _makespan(lengths, lanes)

    def _split(self, index: int, req: TransferRequest, stripe: bool = True) -> list[_Part] | ErrorCode:
        """The parts of one request (``stripe``: a value over ``stripe_bytes`` in near-equal parts), or the
        code of a request that cannot be sent."""
        replica = req.replica
        length = replica.length
        try:
            view = req.buffer if req.buffer.format == "B" and req.buffer.ndim == 1 else req.buffer.cast("B")
        except TypeError:
            return ErrorCode.INVALID_ARGUMENT  # not C-contiguous
        if req.op == GrantOp.READ:
            if view.readonly:
                return ErrorCode.INVALID_ARGUMENT
            if len(view) < length:
                return ErrorCode.BUFFER_TOO_SMALL
            op = Op.READ
        else:
            if len(view) != length:
                return ErrorCode.INVALID_ARGUMENT
            op = Op.WRITE
        if len(req.key) > MAX_KEY_BYTES:
            return ErrorCode.KEY_TOO_LONG
        sizes = _near_equal_parts(length, self.stripe_bytes) if stripe else [length]
        check = _ReadCheck(req, len(sizes)) if req.verify and op == Op.READ else None
        flags = FLAG_REVALIDATE if req.revalidate and op == Op.READ else 0
        parts, off = [], 0
        for n in sizes:
            parts.append(_Part(index, op, view[off : off + n], replica, req.key, req.checksum, off, check, flags))
            off += n
        return parts

    def _deal(self, batch: _Batch, endpoint: _Endpoint, parts: list[_Part]) -> list[tuple[_Lane, _Job]]:
        """Give each part to the least-loaded lane (bytes queued + a per-request cost), in order."""
        lanes = endpoint.lanes_for(len(parts))
        if len(lanes) == 1:
            cost = sum(len(p.view) for p in parts) + _PART_OVERHEAD * len(parts)
            return [(lanes[0], _Job(batch, parts, cost))]
        per_lane: list[list[_Part]] = [[] for _ in lanes]
        loads = [lane.load for lane in lanes]
        before = list(loads)
        for part, i in zip(parts, _least_loaded([len(p.view) for p in parts], loads), strict=True):
            per_lane[i].append(part)
        added = [after - start for after, start in zip(loads, before, strict=True)]
        return [
            (lane, _Job(batch, lane_parts, cost))
            for lane, lane_parts, cost in zip(lanes, per_lane, added, strict=True)
            if lane_parts
        ]
