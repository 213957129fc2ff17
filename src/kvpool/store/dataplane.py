"""The store's data plane: READ/WRITE of granted object ranges straight from/into the segment over TCP.

One thread per connection, blocking sockets (the data path is kernel copies, and a blocking
``recv_into(..., MSG_WAITALL)`` of a whole part is one syscall with the GIL released). Kernel socket
timeouts bound how long a peer can stall mid-frame; an idle connection may stay open forever, since
clients keep persistent pools.

Every READ/WRITE carries a grant signed by the master with the segment's secret. The request is checked
in this order, and the first failure is the reply:

====================================  ===================
the connection presented the token    AUTH_FAILED (op HELLO in the reply; the connection is closed)
the segment is served here            SEGMENT_NOT_FOUND
the grant's MAC verifies              AUTH_FAILED
the grant has not expired (wall ms)   GRANT_EXPIRED
part within grant, grant within seg   OUT_OF_BOUNDS
the client's bytes in flight fit      TOO_MANY_BYTES_IN_FLIGHT (store/limits.py)
====================================  ===================

The first check applies only when the cluster requires a token: then a connection must begin with the
HELLOs of the token's challenge-response (common/auth.py, decision 0025; refusals counted per plane).

Only then are bytes moved, and only within [offset + part_offset, + part_length): the segment is never
read or written outside the granted range. A rejected WRITE whose frame is well-formed still has its
payload consumed (into a scratch buffer, never the segment) so the connection stays usable; so do the
refused entries of a WRITEV. READV and WRITEV entries are checked one by one, each as a READ or WRITE. A malformed
frame (bad magic, lengths inconsistent or over the maxima) gets a BAD_FRAME reply and the connection is
closed; an unknown op gets UNKNOWN_OP and is closed (its payload cannot be skipped safely). Other
connections never notice.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpool.common.auth import ServerHandshake, TokenChecker
from kvpool.common.clock import SYSTEM_CLOCK, Clock
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import Grant, GrantOp, verify
from kvpool.common.log import get_logger
from kvpool.proto.frames import (
    DESC,
    FLAG_FROM_PAGES,
    FLAG_REVALIDATE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_VECTOR_DESCS,
    MAX_VECTOR_ENTRIES,
    VECTOR_COUNT,
    VECTOR_MAX_PART,
    Op,
    TransferDesc,
    vector_codes,
)
from kvpool.store.inventory import Inventory
from kvpool.store.limits import ClientLimits, client_of
from kvpool.store.read_by_key import ReadByKey
from kvpool.store.segment import ShmSegment
from kvpool.store.ssd import SsdTier
from kvpool.store.tiering import read_tier_part, serve_tier_read
from kvpool.transfer.rdma_rails import Responder
from kvpool.transfer.rdma_wire import MAX_CONNECT_PAYLOAD, windows_request_from_json
from kvpool.transfer.tcp_socket import (
    FrameReader,
    Spinner,
    send_all,
    send_vectored,
    sendfile_all,
    set_io_timeout,
    spin_window,
    tune_socket,
)

logger = get_logger(__name__)

_SCRATCH_BYTES = 256 * 1024
_MAX_HELD_REPLIES = 16
"""Held replies are sent at the latest when this many wait (a client's pipeline window)."""
_SENDFILE_MIN_BYTES = 128 << 10
"""With ``read_sendfile``, READ parts at least this long are sent with sendfile (when the segment's file
system allows it); a smaller one leaves sooner as one sendmsg than as a header and a sendfile."""
_MAX_READ_PAYLOAD = DESC.size + MAX_KEY_BYTES
MAX_HELLO_PAYLOAD = 4096
"""Longest HELLO payload; a longer one is a malformed frame."""
# struct offsets inside DESC: part_length (7th u64 -> index 6) and key_len (the u16 after it)
_DESC_PART_LENGTH = 6
_DESC_KEY_LEN = 7


@dataclass
class DataPlaneStats:
    """Counters for metrics; ``errors`` maps an ErrorCode name to how many replies carried it."""

    connections: int = 0
    connections_total: int = 0
    connections_rejected: int = 0
    requests: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    reads_revalidated: int = 0
    bytes_read_from_pages: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class _ConnStats:
    """One connection's counters, written only by its own thread (no lock on the hot path)."""

    __slots__ = ("requests", "bytes_read", "bytes_written", "reads_revalidated", "bytes_read_from_pages", "errors")

    def __init__(self) -> None:
        self.requests = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.reads_revalidated = 0
        self.bytes_read_from_pages = 0
        self.errors: dict[ErrorCode, int] = {}

    def error(self, code: ErrorCode) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def fold_into(self, total: DataPlaneStats) -> None:
        total.requests += self.requests
        total.bytes_read += self.bytes_read
        total.bytes_written += self.bytes_written
        total.reads_revalidated += self.reads_revalidated
        total.bytes_read_from_pages += self.bytes_read_from_pages
        for code, n in self.errors.items():
            total.errors[code.name] = total.errors.get(code.name, 0) + n


class _Close(Exception):
    """End this connection after replying ``code`` (best effort) and logging ``message``."""

    def __init__(self, code: ErrorCode, message: str, req_id: int = 0, op: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.req_id = req_id
        self.op = op


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    stats: _ConnStats
    thread: threading.Thread | None = None
    authed: bool = True  # False until the client proved the token when the cluster requires one
    handshake: ServerHandshake | None = None
    client: str = ""  # the peer's host: what per-client limits count
    held: list[bytes] = field(default_factory=list)
    """Bare replies not sent yet: they leave together once no further request is waiting (see _loop)."""


class DataPlaneServer:
    """Serves PING, STORE_INFO, READ(V), WRITE(V) and RECORD on one TCP port for the given segments."""

    def __init__(
        self,
        host: str,
        port: int,
        segments: dict[int, ShmSegment],
        secrets: dict[int, bytes],
        inventory: Inventory,
        max_connections: int = 1024,
        clock: Clock = SYSTEM_CLOCK,
        store_info: Callable[[], dict[str, Any]] | None = None,
        stall_timeout_s: float = 30.0,
        socket_buffer: int = 4 << 20,
        auth: TokenChecker | None = None,
        limits: ClientLimits | None = None,
        spin_us: int = 0,
        read_sendfile: bool = False,
        rdma: Responder | None = None,
    ) -> None:
        self.host = host
        self.rdma = rdma
        """Answers RDMA_CONNECT (one-sided RDMA to the segments, docs/rdma.md); None: clients use TCP."""
        self.port = port
        self._inventory = inventory
        self._max_connections = max_connections
        self._clock = clock
        self._store_info = store_info
        self._stall_timeout_s = stall_timeout_s
        self._socket_buffer = socket_buffer
        self._spin_s = spin_us / 1e6
        self._read_sendfile = read_sendfile
        # Copy-on-write: the hot path reads these dicts without a lock; changes replace them whole.
        self._segments: dict[int, ShmSegment] = dict(segments)
        self._secrets: dict[int, bytes] = dict(secrets)
        self._max_part = max((s.size for s in self._segments.values()), default=0)
        self._tiers: dict[int, tuple[SsdTier, bytes]] = {}
        """SSD-tier segments (READ only; the store itself writes them): id -> (tier, grant secret)."""
        self._no_sendfile: set[int] = set()
        """Segments whose file refused sendfile (a kernel or file system without splice): copied instead."""
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._totals = DataPlaneStats()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._stopping = False
        # Cluster token (HELLO first on every connection when required) and per-client limits.
        self.auth = auth or TokenChecker(b"")
        self.limits = limits or ClientLimits()
        self.read_by_key = ReadByKey(inventory, lambda: self._segments, self.limits)
        """Answers READ_KEY, the speculative read by key (store/read_by_key.py, decision 0031)."""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Bind and start accepting; ``port`` is the bound port afterwards."""
        if self._listener is not None:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "data plane already started")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.create_server((self.host, self.port), family=family, backlog=1024, reuse_port=False)
        self.port = listener.getsockname()[1]
        self._wake_r, self._wake_w = os.pipe()
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"kvpool-dp-accept-{self.port}", daemon=True)
        self._acceptor.start()
        logger.info("data plane listening on %s:%d (%d segments)", self.host, self.port, len(self._segments))

    def stop(self) -> None:
        """Close the listener and every connection, and join all threads. Safe to call twice."""
        with self._lock:
            if self._stopping or self._listener is None:
                self._stopping = True
                return
            self._stopping = True
        os.write(self._wake_w, b"x")
        if self._acceptor is not None:
            self._acceptor.join()
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            _shutdown(conn.sock)  # wakes its thread from recv/send
        for conn in conns:
            if conn.thread is not None:
                conn.thread.join()

    def __enter__(self) -> DataPlaneServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ segments
    def add_segment(self, segment: ShmSegment, secret: bytes) -> None:
        with self._lock:
            self._segments = {**self._segments, segment.id: segment}
            self._secrets = {**self._secrets, segment.id: secret}
            self._max_part = max(s.size for s in self._segments.values())

    def add_tier(self, segment_id: int, tier: SsdTier, secret: bytes) -> None:
        """Serve READs of an SSD-tier segment (its bytes come from files: store/tiering.py)."""
        with self._lock:
            self._tiers = {**self._tiers, segment_id: (tier, secret)}

    def remove_segment(self, segment_id: int) -> None:
        """Stop serving a segment (requests in flight on it finish; new ones get SEGMENT_NOT_FOUND)."""
        with self._lock:
            self._segments = {k: v for k, v in self._segments.items() if k != segment_id}
            self._secrets = {k: v for k, v in self._secrets.items() if k != segment_id}
            self._max_part = max((s.size for s in self._segments.values()), default=0)
        self._cut_off_rdma(segment_id)

    def _cut_off_rdma(self, segment_id: int) -> None:
        """The QPs admitted to a removed segment die, and their control connections close."""
        if self.rdma is None:
            return
        victims = set(self.rdma.remove_segment(segment_id))
        with self._lock:
            conns = [c for c in self._conns if c in victims]
        for conn in conns:
            _shutdown(conn.sock)

    # ------------------------------------------------------------------ metrics
    def statistics(self) -> DataPlaneStats:
        with self._lock:
            t = self._totals
            snap = DataPlaneStats(
                len(self._conns),
                t.connections_total,
                t.connections_rejected,
                t.requests,
                t.bytes_read,
                t.bytes_written,
                t.reads_revalidated,
                t.bytes_read_from_pages,
                dict(t.errors),
            )
            live = [c.stats for c in self._conns]
        for stats in live:  # racy reads of ints written by other threads: fine for metrics
            stats.fold_into(snap)
        return snap

    # ------------------------------------------------------------------ accepting
    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        with selectors.DefaultSelector() as sel:
            sel.register(listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping:
                for key, _ in sel.select():
                    if key.fd == self._wake_r:
                        return
                    try:
                        sock, addr = listener.accept()
                    except OSError as exc:  # EMFILE, ECONNABORTED...: keep serving the others
                        logger.warning("data plane accept failed: %s", exc)
                        time.sleep(0.01)
                        continue
                    self._admit(sock, _peer_name(addr))

    def _admit(self, sock: socket.socket, peer: str) -> None:
        client = client_of(peer)
        with self._lock:
            full = len(self._conns) >= self._max_connections or self._stopping
            client_full = not full and not self.limits.open(client)
            if full or client_full:
                self._totals.connections_rejected += 1
            else:
                conn = _Conn(sock, peer, _ConnStats(), authed=not self.auth.required, client=client)
                self._conns.add(conn)
                self._totals.connections_total += 1
        if full or client_full:
            if full:
                logger.warning("data plane: %s refused, %d connections open", peer, self._max_connections)
            else:
                logger.warning(
                    "data plane: %s refused, %d connections open from %s",
                    peer,
                    self.limits.max_connections,
                    client,
                )
            _reply_and_close(sock, ErrorCode.TOO_MANY_CONNECTIONS, 0, 0)
            return
        conn.thread = threading.Thread(target=self._serve, args=(conn,), name=f"kvpool-dp-{peer}", daemon=True)
        conn.thread.start()

    # ------------------------------------------------------------------ one connection
    def _serve(self, conn: _Conn) -> None:
        sock = conn.sock
        try:
            sock.settimeout(None)
            tune_socket(sock, self._socket_buffer)
            set_io_timeout(sock, self._stall_timeout_s)
            reader = FrameReader(sock)
            if self._spin_s:  # the next request of a client sending one at a time comes soon
                reader.spinner = Spinner(self._spin_s)
            self._loop(conn, reader)
        except _Close as exc:
            conn.stats.error(exc.code)
            logger.warning("data plane: closing %s: %s: %s", conn.peer, exc.code.name, exc)
            # The requests answered before this one keep their (held) answers.
            _reply_and_close(sock, exc.code, exc.req_id, exc.op, _take_held(conn))
        except BlockingIOError:
            logger.warning("data plane: closing %s: stalled for %.0f s mid-frame", conn.peer, self._stall_timeout_s)
        except (KvPoolError, OSError) as exc:
            logger.debug("data plane: %s gone: %s", conn.peer, exc)
        except Exception:
            logger.exception("data plane: error serving %s", conn.peer)
        finally:
            if self.rdma is not None:
                self.rdma.release(conn)  # the QPs admitted on this connection die with it
            sock.close()
            with self._lock:
                self._conns.discard(conn)
                conn.stats.fold_into(self._totals)
                self.limits.close(conn.client)

    def _loop(self, conn: _Conn, reader: FrameReader) -> None:
        scratch: memoryview | None = None
        stats = conn.stats
        while True:
            # Replies to pipelined requests are held while the next request is already here and leave in
            # one send when none is: one wake-up of the client per burst instead of one per reply.
            if conn.held and not reader.poll():
                self._flush(conn)
            if not self._wait_for_frame(reader):
                return
            magic, op, flags, _status, req_id, length = HEADER.unpack(reader.read(HEADER_SIZE))
            if magic != MAGIC:
                raise _Close(ErrorCode.BAD_FRAME, f"bad magic 0x{magic:08x}")
            stats.requests += 1
            if reader.spinner is not None:
                reader.spinner.window = self._spin_s  # a READ widens it for what follows its answer
            if op == Op.HELLO or not conn.authed:
                self._hello(conn, reader, op, req_id, length)
            elif op == Op.READ:
                self._read(conn, reader, req_id, length, flags & FLAG_REVALIDATE)
            elif op == Op.READV:
                self._readv(conn, reader, req_id, length, flags & FLAG_REVALIDATE)
            elif op in (Op.WRITE, Op.WRITEV):
                if scratch is None:
                    scratch = memoryview(bytearray(_SCRATCH_BYTES))
                (self._write if op == Op.WRITE else self._writev)(conn, reader, req_id, length, scratch)
            elif op == Op.PING:
                self._expect_empty(op, req_id, length)
                self._reply(conn, op, req_id, ErrorCode.OK)
            elif op == Op.STORE_INFO:
                self._expect_empty(op, req_id, length)
                self._send_info(conn, req_id)
            elif op == Op.RECORD:
                self._record(conn, reader, req_id, length)
            elif op == Op.RDMA_CONNECT:
                self._rdma_connect(conn, reader, req_id, length)
            elif op == Op.RDMA_WINDOWS:
                self._rdma_windows(conn, reader, req_id, length)
            elif op == Op.READ_KEY:
                self._read_key(conn, reader, req_id, length)
            else:
                raise _Close(ErrorCode.UNKNOWN_OP, f"unknown op {op}", req_id, op)

    def _hello(self, conn: _Conn, reader: FrameReader, op: int, req_id: int, length: int) -> None:
        """The HELLOs of the token's challenge-response (common/auth.py); any other request before the
        client proved the token is refused and closed.

        The refusal's reply names op HELLO, so a client tells it from a grant's AUTH_FAILED (which
        leaves the connection open). Without a required token, HELLO is answered OK whatever it holds.
        """
        if op != Op.HELLO:
            self.auth.refuse("data")
            raise _Close(
                ErrorCode.AUTH_FAILED,
                f"op {op} before HELLO: the cluster token is required",
                req_id,
                Op.HELLO,
            )
        if length > MAX_HELLO_PAYLOAD:
            raise _Close(ErrorCode.BAD_FRAME, f"HELLO of {length} bytes", req_id, Op.HELLO)
        if conn.handshake is None:
            conn.handshake = self.auth.handshake("data")
        code, body, why = conn.handshake.answer(bytes(reader.read(length)))
        conn.authed = conn.handshake.done
        if code != ErrorCode.OK:
            raise _Close(code, why, req_id, Op.HELLO)
        _hold(conn, HEADER.pack(MAGIC, Op.HELLO, 0, 0, req_id, len(body)) + body)

    def _wait_for_frame(self, reader: FrameReader) -> bool:
        """Block until the next frame starts; an idle connection may wait forever. False on a clean EOF."""
        while True:
            try:
                return reader.wait_readable()
            except BlockingIOError:  # the stall timeout fired between frames: that is only idleness
                if self._stopping:
                    return False

    @staticmethod
    def _expect_empty(op: int, req_id: int, length: int) -> None:
        if length:
            raise _Close(ErrorCode.BAD_FRAME, f"op {op} with a {length}-byte payload", req_id, op)

    def _read(self, conn: _Conn, reader: FrameReader, req_id: int, length: int, revalidate: int) -> None:
        if not DESC.size <= length <= _MAX_READ_PAYLOAD:
            raise _Close(ErrorCode.BAD_FRAME, f"READ payload of {length} bytes", req_id, Op.READ)
        raw = reader.read(length)
        fields = DESC.unpack_from(raw)
        if fields[_DESC_KEY_LEN] != length - DESC.size:
            raise _Close(
                ErrorCode.BAD_FRAME,
                f"READ payload of {length} bytes, key of {fields[_DESC_KEY_LEN]}",
                req_id,
                Op.READ,
            )
        desc = _desc(GrantOp.READ, fields, bytes(raw[DESC.size :]))
        tier = self._tiers.get(desc.grant.segment_id)
        if tier is not None:  # an SSD-tier replica: sendfile from its file
            if conn.held:
                self._flush(conn)
            code, sent = serve_tier_read(conn.sock, tier[0], tier[1], desc, req_id, self._clock.wall_ms())
            if code != ErrorCode.OK:
                conn.stats.error(code)
                self._reply(conn, Op.READ, req_id, code)
            conn.stats.bytes_read += sent
            return
        code, seg = self._check_and_reserve(conn, desc, revalidate)
        if seg is None:
            conn.stats.error(code)
            self._reply(conn, Op.READ, req_id, code)
            return
        try:
            self._send_part(conn, seg, req_id, desc.grant.offset + desc.part_offset, desc.part_length)
        finally:
            self.limits.release(conn.client, desc.part_length)
        conn.stats.bytes_read += desc.part_length
        if reader.spinner is not None:  # the client's next request comes once it has taken these bytes in
            reader.spinner.window = spin_window(self._spin_s, desc.part_length)

    def _read_key(self, conn: _Conn, reader: FrameReader, req_id: int, length: int) -> None:
        code, sent = self.read_by_key.serve(conn.sock, conn.client, lambda: _take_held(conn), reader, req_id, length)
        if code == ErrorCode.BAD_FRAME:
            raise _Close(code, f"READ_KEY payload of {length} bytes", req_id, Op.READ_KEY)
        if code != ErrorCode.OK:
            conn.stats.error(code)
            self._reply(conn, Op.READ_KEY, req_id, code)
        conn.stats.bytes_read += sent

    def _readv(self, conn: _Conn, reader: FrameReader, req_id: int, length: int, revalidate: int) -> None:
        """Several READs in one frame (frames.py): every entry checked as a READ, one answer for all."""
        if length > MAX_VECTOR_DESCS:
            raise _Close(ErrorCode.BAD_FRAME, f"READV payload of {length} bytes", req_id, Op.READV)
        request = _Payload(reader, length, Op.READV, req_id)
        descs = request.descs(GrantOp.READ, probe=True)
        if request.left:
            raise _Close(ErrorCode.BAD_FRAME, f"READV has {request.left} bytes left over", req_id, Op.READV)
        if not descs:  # a client asking whether this store takes READV/WRITEV
            _hold(conn, HEADER.pack(MAGIC, Op.READV, 0, 0, req_id, 0))
            return
        conn.stats.requests += len(descs) - 1
        codes: list[int] = []
        data: list[Any] = []
        reserved = 0
        try:
            for desc in descs:
                code, chunk = self._readv_entry(conn, desc, revalidate)
                codes.append(int(code))
                if chunk is None:
                    conn.stats.error(code)
                    continue
                data.append(chunk)
                if isinstance(chunk, memoryview):
                    reserved += len(chunk)
            payload = sum(len(chunk) for chunk in data)
            header = (
                _take_held(conn)
                + HEADER.pack(MAGIC, Op.READV, 0, 0, req_id, 4 * len(descs) + payload)
                + vector_codes(len(descs)).pack(*codes)
            )
            send_vectored(conn.sock, [header, *data])
        finally:
            for chunk in data:
                if isinstance(chunk, memoryview):
                    chunk.release()
            self.limits.release(conn.client, reserved)
        conn.stats.bytes_read += payload

    def _readv_entry(
        self, conn: _Conn, desc: TransferDesc, revalidate: int
    ) -> tuple[ErrorCode, memoryview | bytes | None]:
        """One READV entry: its bytes (a view of the segment, reserved in the client's in-flight budget;
        or bytes read from the SSD tier), or None and the failure's code."""
        tier = self._tiers.get(desc.grant.segment_id)
        if tier is not None:
            code, value = read_tier_part(tier[0], tier[1], desc, self._clock.wall_ms())
            return code, value
        code, seg = self._check_and_reserve(conn, desc, revalidate)
        if seg is None:
            return code, None
        start = desc.grant.offset + desc.part_offset
        return ErrorCode.OK, seg.view[start : start + desc.part_length]

    def _writev(self, conn: _Conn, reader: FrameReader, req_id: int, length: int, scratch: memoryview) -> None:
        """Several WRITEs in one frame (frames.py): every entry checked as a WRITE; the bytes of a refused
        one are received into ``scratch``, never the segment; one answer for all."""
        request = _Payload(reader, length, Op.WRITEV, req_id)
        descs = request.descs(GrantOp.WRITE)
        sizes = [d.part_length for d in descs]
        if max(sizes) >= VECTOR_MAX_PART or sum(sizes) != request.left:
            raise _Close(
                ErrorCode.BAD_FRAME,
                f"WRITEV of parts {sizes} (each under {VECTOR_MAX_PART}) in {request.left} bytes",
                req_id,
                Op.WRITEV,
            )
        conn.stats.requests += len(descs) - 1
        codes: list[int] = []
        dests: list[memoryview] = []
        landing: list[tuple[TransferDesc, memoryview]] = []
        try:
            for desc in descs:
                code, seg = self._check_and_reserve(conn, desc)
                codes.append(int(code))
                if seg is None:
                    conn.stats.error(code)
                    dests.append(scratch[: desc.part_length])
                    continue
                dest = self._begin_landing(seg, desc)
                landing.append((desc, dest))
                dests.append(dest)
            reader.read_into_many(dests)
        finally:
            for desc, dest in landing:
                dest.release()
                self.limits.release(conn.client, desc.part_length)
        for desc, _ in landing:
            self._landed(conn, desc)
        table = vector_codes(len(descs))
        _hold(conn, HEADER.pack(MAGIC, Op.WRITEV, 0, 0, req_id, table.size) + table.pack(*codes))

    def _send_part(self, conn: _Conn, seg: ShmSegment, req_id: int, start: int, length: int) -> None:
        """The READ answer: header, then the segment's bytes [start, start + length).

        Copied from the mapping by one sendmsg, unless the store was started with ``read_sendfile``: then a
        large part leaves from the segment file by sendfile and the socket references the segment's
        pages (decision 0009: the store copies nothing; decision 0017: on some hosts the whole transfer
        is slower that way). The pages may change before the client has received them only if the range
        was re-allocated while its read lease held, i.e. force-removed; every reader verifies the
        object's checksum, so that shows as a mismatch, never as wrong bytes.
        """
        sock = conn.sock
        held = _take_held(conn)
        if self._read_sendfile and seg.fd >= 0 and length >= _SENDFILE_MIN_BYTES and seg.id not in self._no_sendfile:
            # The header leaves with the first bytes of the value.
            sock.sendall(held + HEADER.pack(MAGIC, Op.READ, FLAG_FROM_PAGES, 0, req_id, length), socket.MSG_MORE)
            if sendfile_all(sock, seg.fd, start, length) == length:
                conn.stats.bytes_read_from_pages += length
                return
            # Refused before any byte left (sendfile_all's contract): the whole part is copied below.
            self._no_sendfile.add(seg.id)
            logger.warning("data plane: sendfile refused for segment %s; reads of it are copied", seg.path)
            header = b""
        else:
            header = held + HEADER.pack(MAGIC, Op.READ, 0, 0, req_id, length)
        data = seg.view[start : start + length]
        try:
            send_all(sock, header, data)
        finally:
            data.release()

    def _write(self, conn: _Conn, reader: FrameReader, req_id: int, length: int, scratch: memoryview) -> None:
        if length < DESC.size:
            raise _Close(ErrorCode.BAD_FRAME, f"WRITE payload of {length} bytes", req_id, Op.WRITE)
        fields = DESC.unpack(reader.read(DESC.size))
        key_len, part_length = fields[_DESC_KEY_LEN], fields[_DESC_PART_LENGTH]
        consistent = length == DESC.size + key_len + part_length
        if key_len > MAX_KEY_BYTES or part_length > self._max_part or not consistent:
            raise _Close(
                ErrorCode.BAD_FRAME,
                f"WRITE payload {length} != desc {DESC.size} + key {key_len} + part {part_length}"
                f" (max key {MAX_KEY_BYTES}, max part {self._max_part})",
                req_id,
                Op.WRITE,
            )
        desc = _desc(GrantOp.WRITE, fields, bytes(reader.read(key_len)))
        code, seg = self._check_and_reserve(conn, desc)
        if seg is None:
            reader.skip(part_length, scratch)  # keep the connection in sync; never touch the segment
            conn.stats.error(code)
            self._reply(conn, Op.WRITE, req_id, code)
            return
        dest = self._begin_landing(seg, desc)
        try:
            reader.read_into(dest)
        finally:
            dest.release()
            self.limits.release(conn.client, part_length)
        self._landed(conn, desc)
        self._reply(conn, Op.WRITE, req_id, ErrorCode.OK)

    def _begin_landing(self, seg: ShmSegment, desc: TransferDesc) -> memoryview:
        """A checked WRITE part is about to land: the inventory drops what it overwrites (before any byte
        lands); returns the segment's view of the part (the caller releases it)."""
        g = desc.grant
        self._inventory.begin_write(g.segment_id, g.offset, g.length, g.key, desc.checksum)
        start = g.offset + desc.part_offset
        return seg.view[start : start + desc.part_length]

    def _landed(self, conn: _Conn, desc: TransferDesc) -> None:
        """A WRITE part's bytes are in the segment: the inventory records them."""
        g = desc.grant
        self._inventory.record_part(
            g.segment_id, g.offset, g.length, g.key, desc.checksum, desc.part_offset, desc.part_length
        )
        conn.stats.bytes_written += desc.part_length

    def _record(self, conn: _Conn, reader: FrameReader, req_id: int, length: int) -> None:
        """A same-node client memcpy'd a whole object into the segment: record it like a finished WRITE.
        The WRITE grant is checked exactly as for a WRITE, so only ranges the master allocated are recorded."""
        if not DESC.size <= length <= DESC.size + MAX_KEY_BYTES:
            raise _Close(ErrorCode.BAD_FRAME, f"RECORD payload of {length} bytes", req_id, Op.RECORD)
        raw = reader.read(length)
        fields = DESC.unpack_from(raw)
        if fields[_DESC_KEY_LEN] != length - DESC.size:
            raise _Close(ErrorCode.BAD_FRAME, f"RECORD payload of {length} bytes", req_id, Op.RECORD)
        desc = _desc(GrantOp.WRITE, fields, bytes(raw[DESC.size :]))
        code, seg = self._check(desc)
        if seg is not None and (desc.part_offset != 0 or desc.part_length != desc.grant.length):
            code, seg = ErrorCode.OUT_OF_BOUNDS, None
        if seg is not None:
            g = desc.grant
            self._inventory.begin_write(g.segment_id, g.offset, g.length, g.key, desc.checksum)
            self._inventory.record_part(g.segment_id, g.offset, g.length, g.key, desc.checksum, 0, g.length)
        else:
            conn.stats.error(code)
        self._reply(conn, Op.RECORD, req_id, code)

    def _rdma_connect(self, conn: _Conn, reader: FrameReader, req_id: int, length: int) -> None:
        """Admit a client's queue pair to the segments its grants name (docs/rdma.md); the connection then
        stays open, carrying RECORDs, for the QP's lifetime."""
        if self.rdma is None:
            raise _Close(ErrorCode.UNKNOWN_OP, "this store serves no RDMA", req_id, Op.RDMA_CONNECT)
        if length > MAX_CONNECT_PAYLOAD:
            raise _Close(ErrorCode.BAD_FRAME, f"RDMA_CONNECT of {length} bytes", req_id, Op.RDMA_CONNECT)
        payload = bytearray(length)
        reader.read_into(memoryview(payload))
        token_verified = self.auth.required and conn.authed
        code, body = self.rdma.handle_connect(payload, conn_id=conn, token_verified=token_verified)
        if code != ErrorCode.OK:
            conn.stats.error(code)
        header = _take_held(conn) + HEADER.pack(MAGIC, Op.RDMA_CONNECT, 0, int(code), req_id, len(body))
        send_all(conn.sock, header, memoryview(body))

    def _rdma_windows(self, conn: _Conn, reader: FrameReader, req_id: int, length: int) -> None:
        """Check each grant exactly as for a TCP request, then bind a memory window over its range to this
        connection's QP (docs/decisions/0020-rdma-grant-windows.md). A WRITE grant's range is dropped from
        the inventory now, before any byte lands, as a TCP WRITE does."""
        if self.rdma is None:
            raise _Close(ErrorCode.UNKNOWN_OP, "this store serves no RDMA", req_id, Op.RDMA_WINDOWS)
        if length > MAX_CONNECT_PAYLOAD:
            raise _Close(ErrorCode.BAD_FRAME, f"RDMA_WINDOWS of {length} bytes", req_id, Op.RDMA_WINDOWS)
        payload = bytearray(length)
        reader.read_into(memoryview(payload))
        try:
            items = windows_request_from_json(payload)
        except KvPoolError as exc:
            raise _Close(exc.code, exc.message, req_id, Op.RDMA_WINDOWS) from None
        codes: list[ErrorCode] = []
        for grant, checksum in items:
            code, seg = self._check(TransferDesc(grant, checksum, 0, grant.length), 0, conn.stats)
            if seg is not None and grant.op == GrantOp.WRITE:
                self._inventory.begin_write(grant.segment_id, grant.offset, grant.length, grant.key, checksum)
            codes.append(code)
        ok = [grant for (grant, _), code in zip(items, codes, strict=True) if code == ErrorCode.OK]
        bound = iter(self.rdma.bind_windows(conn, ok))
        answers = []
        for code in codes:
            if code == ErrorCode.OK:
                code, regions = next(bound)
            else:
                regions = []
            if code != ErrorCode.OK:
                conn.stats.error(code)
            answers.append({"code": int(code), "regions": regions})
        body = json.dumps({"v": 1, "windows": answers}, separators=(",", ":")).encode()
        header = _take_held(conn) + HEADER.pack(MAGIC, Op.RDMA_WINDOWS, 0, 0, req_id, len(body))
        send_all(conn.sock, header, memoryview(body))

    def _check_and_reserve(
        self, conn: _Conn, desc: TransferDesc, revalidate: int = 0
    ) -> tuple[ErrorCode, ShmSegment | None]:
        """``_check``, then take the part's bytes from the client's in-flight budget (released by the
        caller once the bytes have moved)."""
        code, seg = self._check(desc, revalidate, conn.stats)
        if seg is not None and not self.limits.reserve(conn.client, desc.part_length):
            return ErrorCode.TOO_MANY_BYTES_IN_FLIGHT, None
        return code, seg

    def _check(
        self, desc: TransferDesc, revalidate: int = 0, stats: _ConnStats | None = None
    ) -> tuple[ErrorCode, ShmSegment | None]:
        """Authorize one request; the segment only when every check passed. A READ that asks to be
        ``revalidate``d (FLAG_REVALIDATE) and whose grant has ended is served while this store still
        holds exactly that object, untouched since it was written (decision 0014)."""
        g = desc.grant
        seg = self._segments.get(g.segment_id)
        secret = self._secrets.get(g.segment_id)
        if seg is None or secret is None:
            return ErrorCode.SEGMENT_NOT_FOUND, None
        if not verify(secret, g):
            return ErrorCode.AUTH_FAILED, None
        if desc.part_offset + desc.part_length > g.length or g.offset + g.length > seg.size:
            return ErrorCode.OUT_OF_BOUNDS, None
        if self._clock.wall_ms() >= g.expiry_ms:
            if not (
                revalidate
                and g.op == GrantOp.READ
                and self._inventory.holds(g.segment_id, g.offset, g.length, g.key, desc.checksum)
            ):
                return ErrorCode.GRANT_EXPIRED, None
            if stats is not None:
                stats.reads_revalidated += 1
        return ErrorCode.OK, seg

    @staticmethod
    def _reply(conn: _Conn, op: int, req_id: int, code: ErrorCode) -> None:
        """A bare reply (no payload): held, to leave with the next ones (``_flush``)."""
        _hold(conn, HEADER.pack(MAGIC, op, 0, int(code), req_id, 0))

    @staticmethod
    def _flush(conn: _Conn) -> None:
        conn.sock.sendall(_take_held(conn))

    def _send_info(self, conn: _Conn, req_id: int) -> None:
        try:
            payload = json.dumps(self._info()).encode()
        except Exception:  # the store's callback failed: say so, keep the connection
            logger.exception("data plane: store_info failed")
            conn.stats.error(ErrorCode.INTERNAL)
            self._reply(conn, Op.STORE_INFO, req_id, ErrorCode.INTERNAL)
            return
        header = _take_held(conn) + HEADER.pack(MAGIC, Op.STORE_INFO, 0, 0, req_id, len(payload))
        send_all(conn.sock, header, memoryview(payload))

    def _info(self) -> dict[str, Any]:
        if self._store_info is not None:
            return self._store_info()
        return {
            "segments": [{"id": s.id, "size": s.size, "path": s.path} for s in self._segments.values()],
            "port": self.port,
        }


def _hold(conn: _Conn, reply: bytes) -> None:
    """Hold a small reply, to leave with the next ones; all leave at once when too many wait."""
    held = conn.held
    held.append(reply)
    if len(held) >= _MAX_HELD_REPLIES:
        DataPlaneServer._flush(conn)


def _take_held(conn: _Conn) -> bytes:
    """The held replies, to go out ahead of whatever is sent next (in request order); none held any more."""
    held = conn.held
    if not held:
        return b""
    data = b"".join(held)
    held.clear()
    return data


class _Payload:
    """Reads a READV/WRITEV payload piecewise, never past the length its header announced."""

    def __init__(self, reader: FrameReader, length: int, op: Op, req_id: int) -> None:
        self._reader = reader
        self.left = length
        self._op = op
        self._req_id = req_id

    def _take(self, n: int) -> memoryview:
        if n > self.left:
            raise _Close(ErrorCode.BAD_FRAME, f"{self._op.name} payload truncated", self._req_id, self._op)
        self.left -= n
        return self._reader.read(n)

    def descs(self, op: GrantOp, probe: bool = False) -> list[TransferDesc]:
        """The count and the descriptors (a malformed one closes the connection); ``probe`` admits a
        count of 0 (an empty READV: the client's question whether this store takes the vectored ops)."""
        (count,) = VECTOR_COUNT.unpack(self._take(VECTOR_COUNT.size))
        if not (probe and count == 0) and not 1 <= count <= MAX_VECTOR_ENTRIES:
            raise _Close(ErrorCode.BAD_FRAME, f"{self._op.name} of {count} entries", self._req_id, self._op)
        descs = []
        for _ in range(count):
            fields = DESC.unpack(self._take(DESC.size))
            key_len = fields[_DESC_KEY_LEN]
            if key_len > MAX_KEY_BYTES:
                raise _Close(ErrorCode.BAD_FRAME, f"{self._op.name} key of {key_len} bytes", self._req_id, self._op)
            descs.append(_desc(op, fields, bytes(self._take(key_len))))
        return descs


def _desc(op: GrantOp, fields: tuple[Any, ...], key: bytes) -> TransferDesc:
    """A TransferDesc from DESC's unpacked fields (the layout of frames.DESC) and the key bytes."""
    seg, off, length, expiry, csum, part_off, part_len, _key_len, mac = fields
    return TransferDesc(Grant(op, seg, off, length, expiry, key, mac), csum, part_off, part_len)


def _peer_name(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _reply_and_close(sock: socket.socket, code: ErrorCode, req_id: int, op: int, held: bytes = b"") -> None:
    """Best-effort error reply after any ``held`` ones (never blocks on a peer that does not read), then close."""
    try:
        sock.send(held + HEADER.pack(MAGIC, op, 0, int(code), req_id, 0), socket.MSG_DONTWAIT)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()
