"""Batches of the RDMA client: per-request codes, the work requests (chunks) still out per request and per
connection, driving completions until done or a deadline, and the RECORD of written objects afterwards.
The overview is in :mod:`kvpool.transfer.rdma`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.common.clock import SYSTEM_CLOCK, Clock, Deadline
from kvpool.common.errors import ErrorCode
from kvpool.transfer.base import TransferBatch, TransferRequest
from kvpool.transfer.rdma_memory import Piece, _Registration
from kvpool.transfer.rdma_windows import WINDOW_GRACE_MS
from kvpool.transfer.verbs import Opcode

if TYPE_CHECKING:
    from kvpool.transfer.rdma_connection import _Connection

ABORT_AFTER_EXPIRY_MS = WINDOW_GRACE_MS // 2
"""Work still on the NIC this long after its grant expired is aborted, before the store drops the window."""


# ---------------------------------------------------------------------- batches and chunks
@dataclass(eq=False, slots=True)
class _Chunk:
    batch: _Batch
    conn: _Connection
    index: int
    opcode: Opcode
    piece: Piece
    expiry_ms: int = 0
    """The request's grant expiry (wall ms; 0: none): the chunk is never posted after it."""


class _Batch(TransferBatch):
    """Per-request codes; a request is OK only when every one of its work requests completed OK."""

    def __init__(
        self, n_requests: int, deadline: Deadline, poll_interval_s: float, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._clock = clock
        self.codes: list[ErrorCode] = [ErrorCode.OK] * n_requests
        self.deadline = deadline
        self._poll_max = poll_interval_s
        self._lock = threading.Lock()
        self._outstanding = 0
        self._per_request = [0] * n_requests  # work requests not yet completed, per request
        self._per_conn: dict[_Connection, int] = {}  # ... and per connection
        self.connections: list[_Connection] = []
        self.temporary: list[_Registration] = []
        self.writes: list[tuple[int, TransferRequest, _Connection]] = []
        """WRITE requests, to RECORD with their store once their bytes landed."""
        self._finished = False
        self.record = True
        """Whether ``wait`` RECORDs the written objects (False: the caller does, see ``submit_parts``)."""
        self.earliest_expiry_ms = 0
        """The soonest grant expiry of the work requests on the NIC (0: none), see ``_drive``."""

    def fail(self, index: int, code: ErrorCode) -> None:
        with self._lock:
            if self.codes[index] == ErrorCode.OK:
                self.codes[index] = code

    def add_chunks(self, chunks: Sequence[_Chunk]) -> None:
        with self._lock:
            self._outstanding += len(chunks)
            for chunk in chunks:
                if chunk.expiry_ms and (not self.earliest_expiry_ms or chunk.expiry_ms < self.earliest_expiry_ms):
                    self.earliest_expiry_ms = chunk.expiry_ms
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
            if self.record:
                self._record_writes(deadline)
            for reg in self.temporary:
                reg.close()
            self.temporary = []
            self._finished = True
        return list(self.codes)

    def _record_writes(self, deadline: Deadline) -> None:
        """Tell each store which objects landed by RDMA WRITE (RECORD, checked like a WRITE's grant), so its
        inventory holds them as if they had come over TCP; a refused RECORD fails the request."""
        by_conn: dict[_Connection, list[tuple[int, TransferRequest]]] = {}
        for index, req, conn in self.writes:
            if self.codes[index] == ErrorCode.OK:
                by_conn.setdefault(conn, []).append((index, req))
        for conn, items in by_conn.items():
            for (index, _), code in zip(items, conn.record([req for _, req in items], deadline), strict=True):
                self.fail(index, code)

    def _drive(self, deadline: Deadline) -> None:
        """Make progress on every connection this batch uses until its work is done or a deadline passes.

        A work request still on the NIC ``ABORT_AFTER_EXPIRY_MS`` after its grant expired is aborted too:
        the store keeps a window only ``WINDOW_GRACE_MS`` past its grant, and a request that touched an
        invalidated window would kill the QP with everyone's work on it."""
        sleep = 0.0
        while True:
            for conn in self.connections:
                conn.progress()
            if self._outstanding == 0:
                return
            if deadline.expired() or self.deadline.expired() or self._past_grace():
                self._abort()
                return
            if sleep:
                time.sleep(sleep)
            sleep = min(self._poll_max, sleep * 2 or 20e-6)

    def _past_grace(self) -> bool:
        expiry = self.earliest_expiry_ms
        return bool(expiry) and self._clock.wall_ms() >= expiry + ABORT_AFTER_EXPIRY_MS

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
