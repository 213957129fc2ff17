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
from typing import Any

from kvpool.common.auth import TokenChecker
from kvpool.common.clock import SYSTEM_CLOCK, Clock
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import GrantOp
from kvpool.common.log import get_logger
from kvpool.proto.frames import (
    DESC,
    FLAG_REVALIDATE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_KEY_BYTES,
    Op,
    TransferDesc,
)
from kvpool.store.dataplane_conn import (
    _DESC_KEY_LEN,
    DataPlaneStats,
    _Close,
    _Conn,
    _ConnStats,
    _desc,
    _flush,
    _hold,
    _peer_name,
    _reply_and_close,
    _shutdown,
    _take_held,
)
from kvpool.store.dataplane_ops import DataOpsMixin
from kvpool.store.inventory import Inventory
from kvpool.store.limits import ClientLimits, client_of
from kvpool.store.read_by_key import ReadByKey
from kvpool.store.segment import ShmSegment
from kvpool.store.ssd import SsdTier
from kvpool.transfer.rdma_rails import Responder
from kvpool.transfer.rdma_wire import MAX_CONNECT_PAYLOAD, windows_request_from_json
from kvpool.transfer.tcp_socket import (
    FrameReader,
    Spinner,
    send_all,
    set_io_timeout,
    tune_socket,
)

__all__ = ["MAX_HELLO_PAYLOAD", "DataPlaneServer", "DataPlaneStats", "_Close"]

logger = get_logger(__name__)

_SCRATCH_BYTES = 256 * 1024
MAX_HELLO_PAYLOAD = 4096
"""Longest HELLO payload; a longer one is a malformed frame."""


class DataPlaneServer(DataOpsMixin):
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
                _flush(conn)
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
