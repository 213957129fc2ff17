"""The parts of one data-plane connection (``DataPlaneServer`` in dataplane.py): its state and counters,
the ``_Close`` that ends it, the replies it holds until a burst of pipelined requests is answered, the
piecewise reader of a READV/WRITEV payload and the decoding of a descriptor, and the socket helpers that
close it.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from kvpool.common.auth import ServerHandshake
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import Grant, GrantOp
from kvpool.proto.frames import (
    DESC,
    HEADER,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_VECTOR_ENTRIES,
    VECTOR_COUNT,
    Op,
    TransferDesc,
)
from kvpool.transfer.tcp_socket import FrameReader

_MAX_HELD_REPLIES = 16
"""Held replies are sent at the latest when this many wait (a client's pipeline window)."""
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


def _hold(conn: _Conn, reply: bytes) -> None:
    """Hold a small reply, to leave with the next ones; all leave at once when too many wait."""
    held = conn.held
    held.append(reply)
    if len(held) >= _MAX_HELD_REPLIES:
        _flush(conn)


def _take_held(conn: _Conn) -> bytes:
    """The held replies, to go out ahead of whatever is sent next (in request order); none held any more."""
    held = conn.held
    if not held:
        return b""
    data = b"".join(held)
    held.clear()
    return data


def _flush(conn: _Conn) -> None:
    conn.sock.sendall(_take_held(conn))


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
