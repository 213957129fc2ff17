"""Socket helpers and :class:`FrameReader` for the TCP data path, shared by the client's lanes and the store.

The wire constants (buffer sizes, frame bounds, closing replies), the receive/send loops, ``sendfile``,
the spin-before-block receive and the read-ahead frame reader; no lanes, no plans.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger
from kvpool.proto.frames import (
    DESC,
    HEADER,
    HEADER_SIZE,
    VECTOR_COUNT,
)

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
