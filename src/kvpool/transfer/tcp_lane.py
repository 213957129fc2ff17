"""The lane and the endpoint of the TCP transport: one connection with its thread, and a store's lanes.

A :class:`_Lane` drives the pipelined window (in Python, or in the compiled :mod:`kvpool.transfer._lanes`);
an :class:`_Endpoint` owns the lanes of one ``host:port`` and its reconnect cooldown.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from kvpool.common.auth import MAX_HELLO_REPLY, client_handshake
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.log import get_logger
from kvpool.proto.frames import (
    DESC,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_VECTOR_ENTRIES,
    VECTOR_COUNT,
    VECTOR_MAX_PART,
    Op,
    vector_codes,
)
from kvpool.transfer.tcp_plan import _Broken, _Job, _Part, _Solo, _source_page, _vector_frame
from kvpool.transfer.tcp_socket import (
    _CLOSING_CODES,
    _CLOSING_STATUSES,
    _MAX_FRAME,
    _SPIN_MAX_BYTES,
    _VECTOR_FRAME_BASE,
    MAX_INFO_BYTES,
    FrameReader,
    Spinner,
    parse_endpoint,
    send_all,
    send_vectored,
    set_io_timeout,
    spin_window,
    tune_socket,
)

if TYPE_CHECKING:
    from kvpool.transfer.tcp import TcpTransport

try:
    from kvpool.transfer import _lanes as native_lanes
except ImportError:  # built without a C compiler: the Python loop moves every part
    native_lanes = None  # type: ignore[assignment]


logger = get_logger(__name__)


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
                # back for a burst gains nothing: docs/decisions/0050-measurements.md).
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
        raw = table.unpack(reader.read(table.size))
        if any(raw):
            codes = [ErrorCode.OK if c == 0 else as_code(c) for c in raw]
            dests = [p.view for p, c in zip(group, codes, strict=True) if c == ErrorCode.OK] if op == Op.READV else []
        else:  # every entry answered OK (the common case: no per-entry conversion)
            codes = [ErrorCode.OK] * len(group)
            dests = [p.view for p in group] if op == Op.READV else []
        if length != table.size + sum([len(d) for d in dests]):
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
