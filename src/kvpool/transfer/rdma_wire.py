"""The RDMA_CONNECT handshake: its JSON codec (QP info, grants, the store's regions) and the client's
control exchange over the store's data-plane TCP port. The overview of the RDMA transport is in
:mod:`kvpool.transfer.rdma`.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

from kvpool.common.auth import client_handshake
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.grants import Grant, GrantOp
from kvpool.proto import frames
from kvpool.proto.frames import MAX_KEY_BYTES, Op
from kvpool.transfer.verbs import Mtu, QpInfo

PROTOCOL_VERSION = 1
MAX_CONNECT_PAYLOAD = 64 * 1024
"""Largest RDMA_CONNECT request or reply (JSON); a data plane may refuse bigger frames as BAD_FRAME."""


# ---------------------------------------------------------------------- wire format of RDMA_CONNECT
@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """One registered MR of a store segment: segment bytes [offset, offset+length) live at ``addr``."""

    segment_id: int
    offset: int
    length: int
    addr: int
    rkey: int

    def to_json(self) -> dict[str, int]:
        return {
            "segment_id": self.segment_id,
            "offset": self.offset,
            "length": self.length,
            "addr": self.addr,
            "rkey": self.rkey,
        }

    @classmethod
    def from_json(cls, doc: Any) -> RemoteRegion:
        d = _obj(doc, "region")
        return cls(
            _int(d, "segment_id"),
            _int(d, "offset"),
            _int(d, "length", 1),
            _int(d, "addr", 1),
            _int(d, "rkey", 0, 0xFFFFFFFF),
        )


def qp_info_to_json(info: QpInfo) -> dict[str, Any]:
    return {"qp_num": info.qp_num, "lid": info.lid, "gid": info.gid, "psn": info.psn, "mtu": int(info.mtu)}


def qp_info_from_json(doc: Any) -> QpInfo:
    d = _obj(doc, "qp")
    gid = d.get("gid")
    if not isinstance(gid, str) or len(gid) > 64:
        raise KvPoolError(ErrorCode.BAD_FRAME, "RDMA_CONNECT: bad gid")
    return QpInfo(
        qp_num=_int(d, "qp_num", 1, 0xFFFFFF),
        lid=_int(d, "lid", 0, 0xFFFF),
        gid=gid,
        psn=_int(d, "psn", 0, 0xFFFFFF),
        mtu=Mtu(_int(d, "mtu", Mtu.MTU_256, Mtu.MTU_4096)),
    )


def grant_to_json(grant: Grant) -> dict[str, Any]:
    return {
        "op": int(grant.op),
        "segment_id": grant.segment_id,
        "offset": grant.offset,
        "length": grant.length,
        "expiry_ms": grant.expiry_ms,
        "key": grant.key.hex(),
        "mac": grant.mac.hex(),
    }


def grant_from_json(doc: Any) -> Grant:
    d = _obj(doc, "grant")
    try:
        op = GrantOp(_int(d, "op", 1, 2))
        key, mac = bytes.fromhex(str(d.get("key", ""))), bytes.fromhex(str(d.get("mac", "")))
    except ValueError as exc:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"RDMA_CONNECT: bad grant: {exc}") from None
    if len(key) > MAX_KEY_BYTES:
        raise KvPoolError(ErrorCode.BAD_FRAME, "RDMA_CONNECT: grant key too long")
    return Grant(op, _int(d, "segment_id"), _int(d, "offset"), _int(d, "length"), _int(d, "expiry_ms"), key, mac)


MAX_WINDOW_GRANTS = 512
"""Most grants in one RDMA_WINDOWS request (a HiCache batch is 128 pages)."""


def windows_request_from_json(payload: bytes | bytearray | memoryview) -> list[tuple[Grant, int]]:
    """The (grant, checksum) pairs of an RDMA_WINDOWS request; KvPoolError(BAD_FRAME) when malformed."""
    doc = _decode(payload, "RDMA_WINDOWS")
    items = doc.get("grants")
    if not isinstance(items, list) or len(items) > MAX_WINDOW_GRANTS:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"RDMA_WINDOWS: grants must be a list of at most {MAX_WINDOW_GRANTS}")
    out = []
    for item in items:
        d = _obj(item, "window request")
        out.append((grant_from_json(d.get("grant")), _int(d, "checksum")))
    return out


def windows_request_to_json(items: list[tuple[Grant, int]]) -> bytes:
    return _encode({"grants": [{"grant": grant_to_json(g), "checksum": c} for g, c in items]})


def _obj(doc: Any, what: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise KvPoolError(ErrorCode.BAD_FRAME, f"RDMA_CONNECT: {what} is not an object")
    return doc


def _int(d: dict[str, Any], name: str, lo: int = 0, hi: int = (1 << 64) - 1) -> int:
    value = d.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"RDMA_CONNECT: field {name!r} must be an integer in [{lo}, {hi}]")
    return value


def _decode(payload: bytes | bytearray | memoryview, what: str) -> dict[str, Any]:
    if len(payload) > MAX_CONNECT_PAYLOAD:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"{what} of {len(payload)} bytes")
    try:
        doc = json.loads(bytes(payload))
    except ValueError:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"{what} is not JSON") from None
    d = _obj(doc, what)
    if d.get("v") != PROTOCOL_VERSION:
        raise KvPoolError(
            ErrorCode.NOT_SUPPORTED,
            f"{what}: protocol version {d.get('v')!r}, this side speaks {PROTOCOL_VERSION}",
        )
    return d


def _encode(doc: dict[str, Any]) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, **doc}, separators=(",", ":")).encode()


# ---------------------------------------------------------------------- the control exchange (client side)
def exchange_rdma_connect(
    endpoint: str, payload: bytes, *, token: bytes = b"", timeout: float = 2.0
) -> tuple[socket.socket, bytes]:
    """Send RDMA_CONNECT to a store's data-plane port; returns the still-open socket and the reply payload.

    HELLO (the cluster token) goes first when ``token`` is set, as on every framed connection. The socket is
    returned open: the QP lives as long as this connection (the store releases it when the socket closes).
    A refusal raises KvPoolError with the store's code (AUTH_FAILED, GRANT_EXPIRED, NOT_SUPPORTED, ...).
    """
    sock = open_control(endpoint, token=token, timeout=timeout)
    try:
        status, reply = _roundtrip(sock, Op.RDMA_CONNECT, 2, payload)
        if status != ErrorCode.OK:
            raise KvPoolError(status, f"{endpoint} refused RDMA_CONNECT: {_reason(reply)}")
        sock.settimeout(None)
        return sock, reply
    except TimeoutError:
        sock.close()
        raise KvPoolError(ErrorCode.TIMEOUT, f"RDMA_CONNECT to {endpoint}: timed out") from None
    except OSError as exc:
        sock.close()
        raise KvPoolError(ErrorCode.CONNECTION_FAILED, f"RDMA_CONNECT to {endpoint}: {exc}") from None
    except BaseException:
        sock.close()
        raise


def open_control(endpoint: str, *, token: bytes = b"", timeout: float = 2.0) -> socket.socket:
    """A framed connection to a store's data-plane port, past the cluster-token handshake (:func:`hello`)."""
    from kvpool.transfer.tcp_socket import parse_endpoint

    try:
        sock = socket.create_connection(parse_endpoint(endpoint), timeout=timeout)
    except TimeoutError:
        raise KvPoolError(ErrorCode.TIMEOUT, f"connect to {endpoint}: timed out") from None
    except OSError as exc:
        raise KvPoolError(ErrorCode.CONNECTION_FAILED, f"connect to {endpoint}: {exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if token:
            hello(sock, endpoint, token)
        return sock
    except TimeoutError:
        sock.close()
        raise KvPoolError(ErrorCode.TIMEOUT, f"HELLO to {endpoint}: timed out") from None
    except OSError as exc:
        sock.close()
        raise KvPoolError(ErrorCode.CONNECTION_FAILED, f"HELLO to {endpoint}: {exc}") from None
    except BaseException:
        sock.close()
        raise


def hello(sock: socket.socket, endpoint: str, token: bytes) -> None:
    """The cluster-token handshake of the RDMA control connection (challenge-response, decision 0025): the one
    place it happens on this path."""
    client_handshake(token, lambda body: _roundtrip(sock, Op.HELLO, 1, body), endpoint)


def fetch_store_info(endpoint: str, *, token: bytes = b"", timeout: float = 2.0) -> dict[str, Any]:
    """A store's STORE_INFO (JSON object) over a short-lived control connection."""
    sock = open_control(endpoint, token=token, timeout=timeout)
    try:
        status, reply = _roundtrip(sock, Op.STORE_INFO, 3, b"")
    except TimeoutError:
        raise KvPoolError(ErrorCode.TIMEOUT, f"STORE_INFO from {endpoint}: timed out") from None
    except OSError as exc:
        raise KvPoolError(ErrorCode.CONNECTION_FAILED, f"STORE_INFO from {endpoint}: {exc}") from None
    finally:
        sock.close()
    if status != ErrorCode.OK:
        raise KvPoolError(status, f"STORE_INFO from {endpoint}")
    try:
        info = json.loads(reply)
    except ValueError:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"STORE_INFO from {endpoint} is not JSON") from None
    if not isinstance(info, dict):
        raise KvPoolError(ErrorCode.BAD_FRAME, f"STORE_INFO from {endpoint} is not an object")
    return info


def _roundtrip(sock: socket.socket, op: Op, req_id: int, payload: bytes) -> tuple[ErrorCode, bytes]:
    sock.sendall(frames.pack_header(op, req_id, len(payload)) + payload)
    head = frames.recv_header(sock)
    if head.req_id != req_id:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"reply {head.req_id} to request {req_id}")
    if head.length > MAX_CONNECT_PAYLOAD:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"{Op(op).name} reply of {head.length} bytes")
    return as_code(head.status), bytes(frames.recv_exact(sock, head.length))


def _reason(reply: bytes) -> str:
    try:
        doc = json.loads(reply)
        return str(doc.get("error", "")) if isinstance(doc, dict) else ""
    except ValueError:
        return reply[:200].decode(errors="replace")
