"""The client half of RDMA: :class:`RdmaTransport`: what it knows of each store (STORE_INFO), connecting
(one RC QP per store, with cooldowns after failures) and splitting a batch into chunks on those connections.
One connection's posting and completions are in :mod:`kvpool.transfer.rdma_connection`. The overview is in
:mod:`kvpool.transfer.rdma`.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvpool.common.clock import SYSTEM_CLOCK, Clock, Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import Grant, GrantOp
from kvpool.common.log import get_logger
from kvpool.proto.frames import MAX_KEY_BYTES
from kvpool.transfer.base import Replica, TransferBatch, TransferRequest, Transport
from kvpool.transfer.rdma_batch import _Batch, _Chunk
from kvpool.transfer.rdma_connection import _Connection
from kvpool.transfer.rdma_memory import _close_quietly, _LocalMemory, plan_pieces
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
    buffer_address,
)

logger = get_logger(__name__)

DEFAULT_MAX_WR_BYTES = 1 << 30
DEFAULT_SQ_DEPTH = 128
_FAILURES_BEFORE_COOLDOWN = 3
WINDOW_EXPIRY_MARGIN_MS = 1000
"""A grant with less than this left goes over TCP: RDMA spends a round trip on its window first, and a grant that
expires before its work request is posted fails that request (decision 0024)."""
_LEARN_TIMEOUT_S = 0.5  # can_reach has no deadline: a store slow to say STORE_INFO is served over TCP meanwhile
_RELEARN_S = 1.0  # a store met again with an unknown segment (restarted) is asked STORE_INFO again after this

# Connect refusals about the request's grants, not about the path to the store: no cooldown for these.
_REQUEST_REFUSALS = frozenset({ErrorCode.AUTH_FAILED, ErrorCode.GRANT_EXPIRED, ErrorCode.SEGMENT_NOT_FOUND})


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

    def register_device_memory(
        self, base: int, size: int, buffer_id: int, export_dmabuf: Callable[[], int] | None
    ) -> None:
        """Register a GPU allocation for direct NIC<->GPU transfers (decision 0023): a dma-buf MR when
        ``export_dmabuf`` is given, else an MR over the device pointer (nvidia-peermem). Cached per range."""
        self._memory.register_device(base, size, buffer_id, export_dmabuf)

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
