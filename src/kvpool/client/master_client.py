"""The client's link to the master: the lean framed protocol for every hot call, with a connection pool,
per-call deadlines, a circuit breaker (degraded mode: fail fast, reconnect in the background of later
calls) and view fencing (answers from a deposed leader are refused).

The master is given as its gRPC address (``host:port``) or as ``etcd://h1:p1,...``; one gRPC
``GetClusterInfo`` call tells where the framed endpoint is.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from kvpool.client import batching
from kvpool.common import tls
from kvpool.common.auth import client_handshake, grpc_error_code, grpc_metadata, load_token
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.groups import check_master_group
from kvpool.common.log import get_logger
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.proto import master_pb2_grpc as pb_grpc
from kvpool.transfer.tcp_socket import Spinner, set_io_timeout

log = get_logger(__name__)

# Answers up to this size arrive with their header in one receive (a batch of 1,000 exists answers fits).
_READ_AHEAD = 16 * 1024
# A kernel receive/send timeout (SO_RCVTIMEO) surfaces as EAGAIN, a Python-level one as socket.timeout.
_TIMEOUT_ERRORS = (socket.timeout, BlockingIOError)
R = TypeVar("R")

# Master answers that mean "ask another master" rather than "this call failed".
_REDIRECT_CODES = {ErrorCode.NOT_LEADER, ErrorCode.LEADER_WARMING_UP, ErrorCode.STALE_VIEW}
# Failures a retry cannot cure: the call is refused at once with the master's reason.
_NOT_RETRIED = frozenset(
    {ErrorCode.AUTH_FAILED, ErrorCode.AUTH_VERSION_MISMATCH, ErrorCode.INVALID_ARGUMENT, ErrorCode.GROUP_MISMATCH}
)
# A call that timed out sooner than this says nothing about the master (its caller had almost no budget
# left): it must not trip the breaker or drop the connection pool for every other caller.
_MIN_BREAKER_WAIT_S = 0.05


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"bad endpoint {endpoint!r}: expected host:port")
    return host.strip("[]"), int(port)


class _Breaker:
    """Fail fast while the master is down; let one probe through after each backoff."""

    def __init__(self, backoff_s: float, max_backoff_s: float) -> None:
        self._base = backoff_s
        self._max = max_backoff_s
        self._backoff = backoff_s
        self._open_until = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        if not self._open_until:  # closed: the common case needs no lock
            return True
        with self._lock:
            now = time.monotonic()
            if now < self._open_until:
                return False
            if self._open_until:
                # Half-open: this caller probes; others keep failing fast until it reports.
                self._open_until = now + self._backoff
            return True

    def success(self) -> None:
        if not self._open_until and self._backoff == self._base:
            return
        with self._lock:
            self._open_until = 0.0
            self._backoff = self._base

    def failure(self) -> None:
        with self._lock:
            self._open_until = time.monotonic() + self._backoff
            self._backoff = min(self._max, self._backoff * 2)

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self._open_until


class _Conn:
    """One pooled connection to the master's framed endpoint, with what makes a round trip cheap: the
    kernel timeout currently armed (re-armed only when a call's deadline is much nearer) and a
    read-ahead buffer, so that a header and a small answer come in one receive."""

    __slots__ = ("sock", "armed", "buf", "view", "spinner")

    def __init__(self, sock: socket.socket, spin_s: float) -> None:
        self.sock = sock
        self.spinner = Spinner(spin_s) if spin_s else None
        self.armed = -1.0
        self.buf = bytearray(_READ_AHEAD)
        self.view = memoryview(self.buf)

    def arm(self, timeout: float) -> None:
        # Re-arm when the armed timeout would overshoot this call's by more than 10% (or 2 ms): two
        # setsockopt calls per round trip would cost more than the comparison. Also when it would cut the
        # call short by more than 1% (or 2 ms): a call whose deadline was nearly spent arms a tiny timeout,
        # and the connection goes back to the pool with it.
        armed = self.armed
        if armed < 0 or armed - timeout > max(0.002, 0.1 * timeout) or timeout - armed > max(0.002, 0.01 * timeout):
            set_io_timeout(self.sock, timeout)
            self.armed = timeout

    def roundtrip(self, frame: bytes, req_id: int) -> tuple[int, bytes]:
        """Send one request frame; the answer's status and payload."""
        sock, view = self.sock, self.view
        sock.sendall(frame)
        got = 0
        while got < frames.HEADER_SIZE:
            n = sock.recv_into(view[got:]) if self.spinner is None else self.spinner.recv_into(sock, view[got:])
            if n == 0:
                raise KvPoolError(ErrorCode.CONNECTION_FAILED, "connection closed by peer")
            got += n
        head = frames.unpack_header(view[: frames.HEADER_SIZE])
        if head.req_id != req_id or head.length > frames.MAX_RPC_PAYLOAD:
            raise KvPoolError(ErrorCode.BAD_FRAME, "response does not match the request")
        end = frames.HEADER_SIZE + head.length
        if got > end:  # answers come one per request: nothing may follow this one
            raise KvPoolError(ErrorCode.BAD_FRAME, "unexpected bytes after the response")
        if end <= len(self.buf):
            frames.recv_exact_into(sock, view[got:end])
            payload = bytes(view[frames.HEADER_SIZE : end])
        else:
            rest = bytearray(end - got)
            frames.recv_exact_into(sock, memoryview(rest))
            payload = bytes(view[frames.HEADER_SIZE : got]) + rest
        return head.status, payload

    def close(self) -> None:
        self.sock.close()


class MasterClient:
    """Thread-safe: each call checks a connection out of the pool for its round trip."""

    def __init__(
        self,
        master: str,
        *,
        token_file: str = "",
        cluster: str = "kvpool",
        tls_ca: str = "",
        breaker_backoff_s: float = 0.5,
        breaker_max_backoff_s: float = 5.0,
        resolver: Callable[[float], str] | None = None,
        spin_us: int = 0,
        group: tuple[int, int] = (0, 1),
    ) -> None:
        if not master and resolver is None:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "no master address: pass master= or set KVPOOL_MASTER")
        self._resolve = resolver or _make_resolver(master, cluster)
        self._address = master or "(resolver)"
        self._in_outage = False
        self._token = load_token(token_file)
        self._tls_ca = tls_ca
        self._spin_s = spin_us / 1e6
        self._breaker = _Breaker(breaker_backoff_s, breaker_max_backoff_s)
        self._lock = threading.Lock()
        self._idle: list[_Conn] = []
        self._rpc_endpoint = ""
        self._grpc_endpoint = ""
        self._max_view = 0
        self._req_ids = itertools.count(1)
        self.info: pb.ClusterInfoResponse | None = None
        self.group = group
        """(the shard group this client's calls are for, the cluster's group count): a master that serves
        another group, or counts other groups, is refused at discovery (decision 0080)."""

    # --- discovery -----------------------------------------------------------------------------

    def _discover(self, deadline: Deadline) -> str:
        """Ask the (current) master where its framed endpoint is; remember the answer."""
        grpc_endpoint = self._resolve(_timeout(deadline, 2.0))
        with tls.channel(grpc_endpoint, self._tls_ca) as channel:
            stub = pb_grpc.MasterServiceStub(channel)  # type: ignore[no-untyped-call]
            try:
                info = stub.GetClusterInfo(
                    pb.ClusterInfoRequest(),
                    timeout=_timeout(deadline, 2.0),
                    metadata=grpc_metadata(self._token),
                )
            except grpc.RpcError as exc:
                raise KvPoolError(grpc_error_code(exc), f"master {grpc_endpoint}: {exc.code().name}") from exc
        check_master_group(info, *self.group, grpc_endpoint)
        with self._lock:
            self._grpc_endpoint = grpc_endpoint
            self._rpc_endpoint = info.rpc_endpoint
            self.info = info
        return str(info.rpc_endpoint)

    def batch_limits(self, deadline: Deadline) -> tuple[int, int]:
        """(most keys, most key bytes) one call may carry, from the master's GetClusterInfo (asked once,
        if no call asked yet); the master's defaults while it cannot be reached."""
        info = self.info
        if info is None and not self._breaker.is_open:
            with contextlib.suppress(KvPoolError, OSError):
                self._discover(deadline)
            info = self.info
        return batching.limits_of(info)

    def invalidate(self) -> None:
        """Forget the master's endpoints and connections (leader change, unreachable master)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._rpc_endpoint = ""
        for conn in idle:
            conn.close()

    @property
    def grpc_endpoint(self) -> str:
        if not self._grpc_endpoint:
            self._discover(Deadline(5.0))
        return str(self._grpc_endpoint)

    # --- connections ---------------------------------------------------------------------------

    def _checkout(self, deadline: Deadline) -> _Conn:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            endpoint = self._rpc_endpoint
        if not endpoint:
            endpoint = self._discover(deadline)
        sock = socket.create_connection(split_endpoint(endpoint), timeout=_timeout(deadline, 2.0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking with kernel timeouts (armed per call): settimeout() would poll() before every recv.
        sock.settimeout(None)
        conn = _Conn(sock, self._spin_s)
        if self._token:
            self._prove_token(conn, endpoint, deadline)
        return conn

    def _prove_token(self, conn: _Conn, endpoint: str, deadline: Deadline) -> None:
        """The token's challenge-response on a new framed connection (the token itself is never sent)."""

        def exchange(body: bytes) -> tuple[int, bytes]:
            conn.arm(_timeout(deadline, 30.0))
            req_id = next(self._req_ids)
            return conn.roundtrip(frames.pack_header(frames.Op.HELLO, req_id, len(body)) + body, req_id)

        try:
            client_handshake(self._token, exchange, f"master {endpoint}")
        except KvPoolError:
            conn.close()
            raise

    def _checkin(self, conn: _Conn) -> None:
        with self._lock:
            if len(self._idle) < 16:
                self._idle.append(conn)
                return
        conn.close()

    def _roundtrip(self, conn: _Conn, op: int, body: bytes, deadline: Deadline) -> bytes:
        conn.arm(_timeout(deadline, 30.0))
        req_id = next(self._req_ids)
        status, payload = conn.roundtrip(frames.pack_header(op, req_id, len(body)) + body, req_id)
        if status != 0:
            raise KvPoolError(as_code(status), f"master refused op {op}")
        return payload

    # --- calls ---------------------------------------------------------------------------------

    def call(self, op: frames.Op, request: Any, deadline: Deadline) -> Any:
        """One hot call over the framed protocol; raises KvPoolError (UNAVAILABLE when down)."""
        if not self._breaker.allow():
            if not self._leader_changed():
                raise KvPoolError(ErrorCode.UNAVAILABLE, f"master {self._address} unreachable (circuit open)")
            self._breaker.success()  # a new leader is published: try it now, not after the backoff
        _name, _req_type, resp_type = frames.RPC_METHODS[op]
        body = request.SerializeToString()
        started = time.monotonic()
        attempt = -1
        warming = _WarmupWait()
        while attempt < 1:
            attempt += 1
            conn: _Conn | None = None
            try:
                conn = self._checkout(deadline)
                payload = self._roundtrip(conn, op, body, deadline)
                response = resp_type.FromString(payload)  # type: ignore[attr-defined]
                self._checkin(conn)
                conn = None
            except (OSError, KvPoolError) as exc:
                if conn is not None:
                    conn.close()
                code = exc.code if isinstance(exc, KvPoolError) else ErrorCode.UNAVAILABLE
                if code in _NOT_RETRIED:
                    raise
                if code == ErrorCode.LEADER_WARMING_UP:
                    if warming.wait(deadline):
                        attempt -= 1
                        continue
                    raise
                timed_out = isinstance(exc, _TIMEOUT_ERRORS) or deadline.expired()
                if timed_out and time.monotonic() - started < _MIN_BREAKER_WAIT_S:
                    raise KvPoolError(ErrorCode.TIMEOUT, f"master call {op.name} timed out") from exc
                self.invalidate()
                if attempt == 0 and not deadline.expired():
                    continue  # a stale pooled connection (master restarted): one fresh try
                self._breaker.failure()
                self._note_outage(exc)
                if isinstance(exc, _TIMEOUT_ERRORS) or deadline.expired():
                    raise KvPoolError(ErrorCode.TIMEOUT, f"master call {op.name} timed out") from exc
                raise KvPoolError(
                    ErrorCode.UNAVAILABLE, f"master call {op.name}: {self._address} unreachable: {exc}"
                ) from exc
            status = response.status
            status_code = as_code(status.code) if status.code else ErrorCode.OK  # not ErrorCode(): see as_code
            if not self._accept_view(status.view):
                status_code = ErrorCode.STALE_VIEW
            if status_code == ErrorCode.LEADER_WARMING_UP:
                if warming.wait(deadline):
                    attempt -= 1  # the leader serves soon: wait for it within the deadline, not a retry
                    continue
                # The master answers: the deadline was too short for its warm-up, no reason to fail fast.
                raise KvPoolError(status_code, response.status.message or "the leader is warming up")
            if status_code in _REDIRECT_CODES:
                self.invalidate()
                if attempt == 0 and not deadline.expired():
                    continue
                self._breaker.failure()
                raise KvPoolError(status_code, response.status.message or "no serving master")
            self._breaker.success()
            if self._in_outage:
                self._note_recovery()
            if status_code != ErrorCode.OK:
                raise KvPoolError(status_code, response.status.message)
            return response
        raise KvPoolError(ErrorCode.UNAVAILABLE, "no serving master")  # unreachable; keeps mypy sure

    def _note_outage(self, exc: BaseException) -> None:
        """Log an unreachable master once per outage (not once per call: a busy engine makes thousands)."""
        with self._lock:
            if self._in_outage:
                return
            self._in_outage = True
        tried = self._grpc_endpoint if self._grpc_endpoint and self._grpc_endpoint != self._address else ""
        log.warning(
            "master %s%s unreachable (%s): calls return UNAVAILABLE (lookups: misses) until it answers; "
            "check --master / KVPOOL_MASTER and that the cluster is up",
            self._address,
            f" (at {tried})" if tried else "",
            exc,
        )

    def _note_recovery(self) -> None:
        with self._lock:
            if not self._in_outage:
                return
            self._in_outage = False
        log.info("master %s reachable again", self._address)

    def _leader_changed(self) -> bool:
        """Whether the address resolver now names another master than the one that failed."""
        try:
            return self._resolve(0.0) != self._grpc_endpoint
        except KvPoolError:
            return False

    def _accept_view(self, view: int) -> bool:
        """Refuse answers from a leader older than one we already heard from (a deposed leader)."""
        if view == self._max_view:  # the leader we know: no lock needed to say yes
            return True
        with self._lock:
            if view < self._max_view:
                return False
            self._max_view = view
            return True

    def grpc_call(self, method: str, request: Any, timeout: float = 10.0) -> Any:
        """A control-plane call over gRPC (admin, stats); raises KvPoolError."""
        with tls.channel(self.grpc_endpoint, self._tls_ca) as channel:
            stub = pb_grpc.MasterServiceStub(channel)  # type: ignore[no-untyped-call]
            try:
                response = getattr(stub, method)(request, timeout=timeout, metadata=grpc_metadata(self._token))
            except grpc.RpcError as exc:
                self.invalidate()
                raise KvPoolError(grpc_error_code(exc), f"{method}: {exc.code().name} {exc.details()}") from exc
        code = as_code(response.status.code)
        if code != ErrorCode.OK:
            raise KvPoolError(code, response.status.message)
        return response

    @property
    def degraded(self) -> bool:
        return self._breaker.is_open

    def close(self) -> None:
        self.invalidate()


class _WarmupWait:
    """Waits between tries while a new leader warms up: short at first, then longer, never past the
    call's deadline."""

    FIRST_S = 0.02
    LONGEST_S = 0.5

    def __init__(self) -> None:
        self._next = self.FIRST_S

    def wait(self, deadline: Deadline) -> bool:
        """Sleep before the next try; False (no sleep) when the deadline leaves no room for one."""
        remaining = deadline.remaining()
        if remaining is not None and remaining <= self._next:
            return False
        time.sleep(self._next)
        self._next = min(self.LONGEST_S, self._next * 2)
        return True


def _timeout(deadline: Deadline, cap: float) -> float:
    remaining = deadline.remaining()
    return cap if remaining is None else max(0.001, min(cap, remaining))


def _make_resolver(master: str, cluster: str) -> Callable[[float], str]:
    """host:port -> itself; etcd://... -> the current leader's gRPC endpoint (watched)."""
    if master.startswith("etcd://"):
        from kvpool.common.leader_watch import etcd_resolver

        return etcd_resolver(master, cluster)
    split_endpoint(master)  # validate early: a typo should fail at construction, not on first call

    def direct(wait_s: float = 0.0) -> str:
        return master

    return direct
