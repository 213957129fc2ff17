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
  only leave data cold in socket buffers (docs/decisions/0050-measurements.md). READ requests are sent half a
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
and the socket helpers live in :mod:`kvpool.transfer.tcp_socket`, shared with the store's data-plane server;
the striping and dealing plan in :mod:`kvpool.transfer.tcp_plan`; the lane and endpoint in
:mod:`kvpool.transfer.tcp_lane`. This module keeps the :class:`TcpTransport` facade.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import GrantOp
from kvpool.common.log import get_logger, log_once
from kvpool.proto.frames import (
    FLAG_REVALIDATE,
    MAX_KEY_BYTES,
    Op,
)
from kvpool.transfer.base import TransferBatch, TransferRequest, Transport
from kvpool.transfer.tcp_lane import _Endpoint, _Lane
from kvpool.transfer.tcp_plan import _PART_OVERHEAD, _Batch, _Job, _least_loaded, _makespan, _Part, _ReadCheck
from kvpool.transfer.tcp_plan import _near_equal_parts as _near_equal_parts
from kvpool.transfer.tcp_socket import SOCKET_BUFFER as SOCKET_BUFFER
from kvpool.transfer.tcp_socket import Spinner as Spinner
from kvpool.transfer.tcp_socket import parse_endpoint as parse_endpoint
from kvpool.transfer.tcp_socket import recv_all_into as recv_all_into
from kvpool.transfer.tcp_socket import send_vectored as send_vectored
from kvpool.transfer.tcp_socket import sendfile_all as sendfile_all
from kvpool.transfer.tcp_socket import set_io_timeout as set_io_timeout
from kvpool.transfer.tcp_socket import spin_recv_into as spin_recv_into
from kvpool.transfer.tcp_socket import spin_window as spin_window
from kvpool.transfer.tcp_socket import tune_socket as tune_socket

try:
    from kvpool.transfer import _lanes as native_lanes
except ImportError:  # built without a C compiler: the Python loop moves every part
    native_lanes = None  # type: ignore[assignment]

logger = get_logger(__name__)


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
        # Payload bytes a lane keeps in flight: past about two parts more only adds data sitting cold in
        # socket buffers (docs/decisions/0050-measurements.md, "The TCP transport's pipeline").
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
        busy whole, each extra part only costs a request (docs/decisions/0050-measurements.md). So the values
        go whole unless striping finishes sooner, by the dealing's own cost model: 5 values of 4 MiB on 4
        lanes are striped, 8 go whole."""
        stripe = self.stripe_bytes
        if all(n <= stripe for n in lengths):
            return False
        lanes = self.connections_per_endpoint
        striped = [part for n in lengths for part in _near_equal_parts(n, stripe)]
        return _makespan(striped, lanes) < _makespan(lengths, lanes)

    def _split(self, index: int, req: TransferRequest, stripe: bool = True) -> list[_Part] | ErrorCode:
        """The parts of one request (``stripe``: a value over ``stripe_bytes`` in near-equal parts), or the
        code of a request that cannot be sent. Runs once per page of a batch: a value that goes whole
        (most of them) becomes its one part without the striping arithmetic."""
        replica = req.replica
        length = replica.length
        view = req.buffer
        if view.format != "B" or view.ndim != 1:
            try:
                view = view.cast("B")
            except TypeError:
                return ErrorCode.INVALID_ARGUMENT  # not C-contiguous
        reading = req.op == GrantOp.READ
        if reading:
            if view.readonly:
                return ErrorCode.INVALID_ARGUMENT
            if len(view) < length:
                return ErrorCode.BUFFER_TOO_SMALL
        elif len(view) != length:
            return ErrorCode.INVALID_ARGUMENT
        if len(req.key) > MAX_KEY_BYTES:
            return ErrorCode.KEY_TOO_LONG
        op = Op.READ if reading else Op.WRITE
        flags = FLAG_REVALIDATE if reading and req.revalidate else 0
        if not stripe or length <= self.stripe_bytes:
            check = _ReadCheck(req, 1) if reading and req.verify else None
            whole = view if len(view) == length else view[:length]
            return [_Part(index, op, whole, replica, req.key, req.checksum, 0, check, flags)]
        sizes = _near_equal_parts(length, self.stripe_bytes)
        check = _ReadCheck(req, len(sizes)) if reading and req.verify else None
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
