"""Per-grant memory windows (docs/decisions/0020-rdma-grant-windows.md). The store side (:class:`WindowTable`):
one type-2 window per valid grant, bound to the client's QP over exactly the grant's range and access,
invalidated when the grant expires, when the control connection closes, or when its segment is revoked or
removed. The client side (:class:`ClientWindows`): the RDMA_WINDOWS exchange and a cache by grant.
"""

from __future__ import annotations

import heapq
import socket
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from kvpool.common.clock import Clock
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.grants import Grant
from kvpool.common.log import get_logger
from kvpool.proto import frames
from kvpool.transfer.rdma_memory import _close_quietly
from kvpool.transfer.rdma_wire import (
    MAX_CONNECT_PAYLOAD,
    MAX_WINDOW_GRANTS,
    RemoteRegion,
    _decode,
    windows_request_to_json,
)
from kvpool.transfer.verbs import MemoryRegion, VerbsError

logger = get_logger(__name__)

SWEEP_INTERVAL_S = 0.02
"""How often expired windows are invalidated: a window outlives its grace by at most about this."""

WINDOW_GRACE_MS = 2000
"""How long a window outlives its grant. A client posts no work request under an expired grant
(``rdma_client``), so the grace only lets work posted before the expiry complete on the NIC instead of
dying with REM_ACCESS_ERR (which would kill the QP and every other request on it). It stays well inside the
master's quarantine of a revoked put's range (``RECLAIM_GRACE_S``, 5 s), so no late WRITE can land in a
range handed to a newer object; a READ that completes after its lease ended is discarded by the client
(``LEASE_EXPIRED``). Decision 0024."""


@dataclass(eq=False)
class _Window:
    conn_id: Hashable
    segment_id: int
    expiry_ms: int
    mr: MemoryRegion
    closed: bool = False


@dataclass
class WindowTable:
    """The live windows, by control connection and by expiry; a sweeper thread invalidates expired ones."""

    clock: Clock
    flush: Callable[[], None]
    """Makes binds and invalidations take effect (``DeviceContext.flush_windows``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _by_conn: dict[Hashable, list[_Window]] = field(default_factory=dict)
    _expiries: list[tuple[int, int, _Window]] = field(default_factory=list)
    _seq: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    bound: int = 0
    """Windows bound so far (a metric)."""
    bytes_bound: int = 0
    """Bytes of segment reachable through the windows bound so far (a metric: RDMA is in use)."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._sweep_loop, name="kvpool-rdma-windows", daemon=True)
        self._thread.start()

    def add(self, conn_id: Hashable, segment_id: int, expiry_ms: int, mr: MemoryRegion) -> None:
        """Track a bound window; ``expiry_ms`` is its grant's: it is invalidated ``WINDOW_GRACE_MS`` later."""
        if expiry_ms:
            expiry_ms += WINDOW_GRACE_MS
        window = _Window(conn_id, segment_id, expiry_ms, mr)
        with self._lock:
            self._by_conn.setdefault(conn_id, []).append(window)
            self._seq += 1
            heapq.heappush(self._expiries, (expiry_ms, self._seq, window))
            self.bound += 1
            self.bytes_bound += mr.length

    def live(self) -> int:
        with self._lock:
            return sum(len(ws) for ws in self._by_conn.values())

    def sweep(self) -> int:
        """Invalidate every window whose grant has expired; returns how many."""
        now = self.clock.wall_ms()
        expired: list[_Window] = []
        with self._lock:
            while self._expiries and self._expiries[0][0] <= now:
                _, _, window = heapq.heappop(self._expiries)
                if not window.closed:
                    expired.append(window)
                    self._forget(window)
        self._invalidate(expired)
        return len(expired)

    def release(self, conn_id: Hashable) -> None:
        with self._lock:
            windows = self._by_conn.pop(conn_id, [])
            for window in windows:
                window.closed = True
        self._invalidate(windows)

    def revoke(self, segment_id: int | None) -> None:
        """Invalidate the windows into ``segment_id`` (None: all)."""
        with self._lock:
            victims = [
                w for ws in self._by_conn.values() for w in ws if segment_id is None or w.segment_id == segment_id
            ]
            for window in victims:
                self._forget(window)
        self._invalidate(victims)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.revoke(None)
        with self._lock:
            self._expiries = []

    def _forget(self, window: _Window) -> None:
        """Drop a window from the connection index (called with the lock held)."""
        window.closed = True
        windows = self._by_conn.get(window.conn_id)
        if windows is not None and window in windows:
            windows.remove(window)
            if not windows:
                del self._by_conn[window.conn_id]

    def _invalidate(self, windows: list[_Window]) -> None:
        for window in windows:
            _close_quietly(window.mr)
        if not windows:
            return
        try:
            self.flush()  # the invalidations completed: the ranges may be reused
        except VerbsError as exc:  # a broken device: its QPs are in error and reach nothing anyway
            logger.warning("rdma: invalidating %d windows did not complete: %s", len(windows), exc)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_INTERVAL_S):
            try:
                self.sweep()
            except Exception:  # a failing sweep must not stop the next ones
                logger.exception("rdma: invalidating expired windows failed")


# ---------------------------------------------------------------------- the client side
_WINDOWS_REQ_ID = 8  # RDMA_WINDOWS request ids on a control connection (1 and 2 were HELLO and RDMA_CONNECT)
_MAX_CACHED = 65536
_FRAME_BUDGET = 48 << 10  # bytes of JSON per RDMA_WINDOWS request, under MAX_CONNECT_PAYLOAD
_GRANT_JSON_BYTES = 320  # one grant's JSON without its key (hex MAC, fields, checksum), rounded up


class ClientWindows:
    """The windows a client holds on one control connection, by grant, reused until the grant expires."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._cache: dict[tuple[int, int, int, int, int, bytes, bytes], tuple[int, list[RemoteRegion]]] = {}

    def get(
        self, sock: socket.socket, items: Sequence[tuple[Grant, int]], timeout: float
    ) -> list[tuple[ErrorCode, list[RemoteRegion]]]:
        """(code, regions) per (grant, checksum): from the cache, else asked in one RDMA_WINDOWS exchange.

        Raises OSError or KvPoolError when the exchange fails (the caller breaks the connection).
        """
        now = self._clock.wall_ms()
        if len(self._cache) > _MAX_CACHED:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        out: list[tuple[ErrorCode, list[RemoteRegion]] | None] = []
        missing: list[int] = []
        for n, (grant, _) in enumerate(items):
            hit = self._cache.get(_key(grant))
            if hit is not None and hit[0] > now:
                out.append((ErrorCode.OK, hit[1]))
            else:
                out.append(None)
                missing.append(n)
        for part in _frames(missing, items):
            answers = _exchange(sock, [items[n] for n in part], timeout)
            for n, (code, regions) in zip(part, answers, strict=True):
                out[n] = (code, regions)
                if code == ErrorCode.OK:
                    self._cache[_key(items[n][0])] = (items[n][0].expiry_ms, regions)
        return [o if o is not None else (ErrorCode.INTERNAL, []) for o in out]


def _frames(positions: list[int], items: Sequence[tuple[Grant, int]]) -> list[list[int]]:
    """``positions`` cut into RDMA_WINDOWS requests that stay under the frame budget (a key's hex is 2x)."""
    out: list[list[int]] = []
    size = 0
    for n in positions:
        cost = _GRANT_JSON_BYTES + 2 * len(items[n][0].key)
        if not out or size + cost > _FRAME_BUDGET or len(out[-1]) >= MAX_WINDOW_GRANTS:
            out.append([])
            size = 0
        out[-1].append(n)
        size += cost
    return out


def _key(grant: Grant) -> tuple[int, int, int, int, int, bytes, bytes]:
    return (int(grant.op), grant.segment_id, grant.offset, grant.length, grant.expiry_ms, grant.mac, grant.key)


def _exchange(
    sock: socket.socket, items: Sequence[tuple[Grant, int]], timeout: float
) -> list[tuple[ErrorCode, list[RemoteRegion]]]:
    payload = windows_request_to_json(list(items))
    sock.settimeout(timeout)
    try:
        sock.sendall(frames.pack_header(frames.Op.RDMA_WINDOWS, _WINDOWS_REQ_ID, len(payload)) + payload)
        head = frames.recv_header(sock)
        if head.req_id != _WINDOWS_REQ_ID or head.length > MAX_CONNECT_PAYLOAD:
            raise KvPoolError(ErrorCode.BAD_FRAME, "RDMA_WINDOWS answer out of order or too long")
        reply = bytes(frames.recv_exact(sock, head.length))
    finally:
        sock.settimeout(None)
    if as_code(head.status) != ErrorCode.OK:
        raise KvPoolError(as_code(head.status), "RDMA_WINDOWS refused")
    doc = _decode(reply, "RDMA_WINDOWS reply")
    answers = doc.get("windows")
    if not isinstance(answers, list) or len(answers) != len(items):
        raise KvPoolError(ErrorCode.BAD_FRAME, "RDMA_WINDOWS reply: one answer per grant expected")
    out = []
    for answer in answers:
        if not isinstance(answer, dict) or not isinstance(answer.get("regions"), list):
            raise KvPoolError(ErrorCode.BAD_FRAME, "RDMA_WINDOWS reply: bad answer")
        out.append(
            (
                as_code(int(answer.get("code", ErrorCode.BAD_FRAME))),
                [RemoteRegion.from_json(r) for r in answer["regions"]],
            )
        )
    return out
