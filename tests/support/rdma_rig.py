"""The RDMA rig of the unit tests and of benchmarks/rdma_post_cost.py: two FAKE "nodes" on one in-process
fabric, the store side answered by RdmaResponder behind a real loopback TCP control channel.

``make_rig(native=...)`` picks how the FAKE NIC is posted to: through the compiled verbs layer's fake
provider (True; where kvpool.transfer._verbs is built), the Python path (False), or the default (None).
"""

from __future__ import annotations

import mmap
import socket
import threading
from dataclasses import dataclass

from kvpool.common.auth import TokenChecker
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import GrantOp, new_secret, sign
from kvpool.proto import frames
from kvpool.proto.frames import Op
from kvpool.transfer.base import Replica, TransferRequest
from kvpool.transfer.rdma import RdmaResponder, RdmaTransport
from kvpool.transfer.verbs_fake import FakeFabric, FakeVerbs
from kvpool.transfer.verbs_native import native_built

NATIVE_MODES = ("native", "python") if native_built() else ("python",)
"""The posting paths a test of the fake can run through here."""

MiB = 1 << 20
SEG_ID = 0x5EED
FAR_FUTURE_MS = 4_000_000_000_000


# ---------------------------------------------------------------------- fixtures
class _Segment:
    """What a store's segment offers the responder: a memoryview over an mmap, and its size."""

    def __init__(self, size: int) -> None:
        self._mm = mmap.mmap(-1, size)
        self.view = memoryview(self._mm)
        self.size = size

    def close(self) -> None:
        self.view.release()
        self._mm.close()


class ControlServer:
    """A minimal store control channel, wired to RdmaResponder exactly as the data plane must be:
    HELLO checks the token; RDMA_CONNECT -> handle_connect(payload, conn_id, token_verified); on close ->
    release(conn_id). ``responder=None`` plays a store without RDMA (UNKNOWN_OP)."""

    def __init__(self, responder: RdmaResponder | None, token: bytes = b"") -> None:
        self.responder = responder
        self.token = token
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._stopping = False
        self.records = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if self._stopping:
                conn.close()
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn_id = conn  # what revoke() hands back, so that we can close it
        handshake = TokenChecker(self.token).handshake("data")
        verified = False
        try:
            while True:
                head = frames.recv_header(conn)
                payload = bytes(frames.recv_exact(conn, head.length))
                if head.op == Op.HELLO:
                    status, body, _ = handshake.answer(payload)
                    verified = bool(self.token) and handshake.done
                elif head.op == Op.RDMA_CONNECT and self.responder is not None:
                    if self.token and not verified:
                        status, body = ErrorCode.AUTH_FAILED, b""
                    else:
                        status, body = self.responder.handle_connect(payload, conn_id=conn_id, token_verified=verified)
                elif head.op == Op.RECORD and self.responder is not None:
                    self.records += 1  # the real data plane checks the grant and records the object
                    status, body = ErrorCode.OK, b""
                else:
                    conn.sendall(frames.pack_header(head.op, head.req_id, 0, ErrorCode.UNKNOWN_OP))
                    return
                conn.sendall(frames.pack_header(head.op, head.req_id, len(body), status) + body)
        except (KvPoolError, OSError):
            pass
        finally:
            if self.responder is not None:
                self.responder.release(conn_id)
            conn.close()

    def drop_connections(self, which: list[object] | None = None) -> None:
        for conn in self._conns:
            if which is None or conn in which:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stopping = True
        try:  # wakes the accept() of the serving thread: close() alone leaves the socket listening
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self.drop_connections()


@dataclass
class Rig:
    fabric: FakeFabric
    client_verbs: FakeVerbs
    store_verbs: FakeVerbs
    segment: _Segment
    secret: bytes
    responder: RdmaResponder
    server: ControlServer
    transport: RdmaTransport

    def replica(
        self,
        op: GrantOp,
        key: bytes,
        offset: int,
        length: int,
        expiry_ms: int = FAR_FUTURE_MS,
        secret: bytes | None = None,
    ) -> Replica:
        mac = sign(secret or self.secret, op, SEG_ID, offset, length, expiry_ms, key)
        return Replica(SEG_ID, "store-node", self.server.endpoint, "", offset, length, expiry_ms, mac)

    def request(
        self,
        op: GrantOp,
        key: bytes,
        offset: int,
        buffer: bytearray | bytes,
        length: int | None = None,
        **kw: object,
    ) -> TransferRequest:
        n = len(buffer) if length is None else length
        replica = self.replica(op, key, offset, n, **kw)  # type: ignore[arg-type]
        return TransferRequest(op, key, replica, memoryview(buffer))

    def one(self, request: TransferRequest) -> ErrorCode:
        """Transfer one request; its code."""
        return self.transport.transfer([request], _deadline())[0]


def make_rig(
    max_mr_bytes: int = 4 * MiB,
    segment_size: int = 16 * MiB,
    token: bytes = b"",
    client_token: bytes = b"",
    native: bool | None = None,
    **transport_kw: object,
) -> Rig:
    fabric = FakeFabric()
    client_verbs = FakeVerbs(fabric, devices=("fake_client",), max_mr_bytes=max_mr_bytes, native=native)
    store_verbs = FakeVerbs(fabric, devices=("fake_store",), max_mr_bytes=max_mr_bytes, native=native)
    segment = _Segment(segment_size)
    secret = new_secret()
    responder = RdmaResponder(store_verbs, {SEG_ID: segment}, {SEG_ID: secret})
    server = ControlServer(responder, token=token)
    transport = RdmaTransport(client_verbs, max_mr_bytes=max_mr_bytes, token=client_token, **transport_kw)  # type: ignore[arg-type]
    transport.note_store_info(server.endpoint, {"rdma": responder.advertisement()})
    return Rig(fabric, client_verbs, store_verbs, segment, secret, responder, server, transport)


def _teardown(r: Rig) -> None:
    r.transport.close()
    r.server.close()
    r.responder.close()
    r.segment.close()


def _deadline() -> Deadline:
    return Deadline(5.0)
