"""kvpool's lean framed protocol: one fixed header, then the payload.

Used by the store's data plane (READ/WRITE of object ranges) and by the master's hot path (the same
protobuf messages as the gRPC service, without gRPC's per-call cost, an order of magnitude more per round
trip in Python: docs/decisions/0050-measurements.md). Little-endian throughout.

Header (28 bytes)::

    magic  u32   b"KVP1"
    op     u16   Op / RPC method id
    flags  u16   FLAG_REVALIDATE on a READ/READV request, FLAG_FROM_PAGES on a READ reply, else 0
    status i32   ErrorCode in responses, 0 in requests
    req_id u64   echoed in the response; responses on one connection come in request order
    length u64   payload bytes that follow

Data-plane READ/WRITE payload: a fixed :data:`DESC` (the grant and the part of the object this request
moves), the key bytes, then (WRITE only) ``part_length`` bytes of data. A READ response carries
``part_length`` bytes. A malformed frame closes the connection; the server keeps serving others.
A READ or READV with :data:`FLAG_REVALIDATE` asks the store to serve an entry whose grant has ended if it
still holds exactly that object (decision 0014); any other request's grant must not have ended.

READV and WRITEV move several small parts in one frame each way (a batch of small values costs a
header, a syscall and a wake-up per frame, not per part). Payload: ``u16 count``
(1..:data:`MAX_VECTOR_ENTRIES`), then ``count`` descriptors (DESC + key) back to back, then (WRITEV only)
the bytes of every entry, in order. WRITEV entries are shorter than :data:`VECTOR_MAX_PART`. The
answer's payload: ``count`` i32 codes, one per entry in order, then (READV only) the bytes of the
entries answered OK, in order. Every entry is checked on its own, exactly as a READ or WRITE: one failed
entry does not fail the others. An empty READV (count 0, nothing else) is a client's question whether
the store takes these ops: answered OK with no payload, or UNKNOWN_OP by a store that predates them.
"""

from __future__ import annotations

import socket
import struct
from enum import IntEnum
from typing import NamedTuple

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import MAC_BYTES, Grant, GrantOp
from kvpool.proto import master_pb2 as pb

MAGIC = 0x3150564B  # b"KVP1" little-endian
HEADER = struct.Struct("<IHHiQQ")
HEADER_SIZE = HEADER.size
FLAG_REVALIDATE = 1
"""Header flag of a READ/READV: an entry with an ended (but authentic) grant is served if the store still
holds exactly that object - the client's cached location of an object whose lease ran out."""
FLAG_FROM_PAGES = 2
"""Header flag of a READ reply (a hint, never needed for correctness): the store sent the payload from
the segment's pages (sendfile), so in the client's kernel its first byte lies at the object's offset plus
the part's, modulo 4 KiB. The compiled lane loop uses it to avoid a slow receive copy (transfer/_lanes.c)."""
# segment_id, obj_offset, obj_length, expiry_ms, checksum, part_offset, part_length, key_len, mac
DESC = struct.Struct(f"<QQQQQQQH{MAC_BYTES}s")
MAX_KEY_BYTES = 512
MAX_RPC_PAYLOAD = 256 * 1024 * 1024
VECTOR_COUNT = struct.Struct("<H")
MAX_VECTOR_ENTRIES = 32
VECTOR_MAX_PART = 128 * 1024
"""Parts shorter than this may travel in READV/WRITEV frames. A longer part goes alone in a READ or
WRITE (one syscall of its own on both sides; a store started with --read-sendfile sends it from the
segment's file: decisions 0009 and 0017)."""
READ_KEY_REQUEST = struct.Struct("<Q")
"""A READ_KEY request's fixed part: the longest object the client takes (a longer one is refused)."""
READ_KEY_META = struct.Struct("<QQQQ")
"""A READ_KEY answer's fixed part: segment_id, offset, length, checksum of the object that follows."""
MAX_VECTOR_DESCS = VECTOR_COUNT.size + MAX_VECTOR_ENTRIES * (DESC.size + MAX_KEY_BYTES)
"""The longest count + descriptors of a READV/WRITEV frame (all of a READV's payload)."""


def vector_codes(count: int) -> struct.Struct:
    """The struct of a READV/WRITEV answer's code table for ``count`` entries."""
    return _VECTOR_CODES[count]


_VECTOR_CODES = [struct.Struct(f"<{n}i") for n in range(MAX_VECTOR_ENTRIES + 1)]


class Op(IntEnum):
    PING = 1
    READ = 2
    WRITE = 3
    STORE_INFO = 4
    RDMA_CONNECT = 5
    HELLO = 6
    """First frame of a connection when the cluster requires a token: payload = the token."""
    RECORD = 7
    """A same-node client wrote an object's bytes into the mapped segment itself: record it in the
    store's inventory. Payload: DESC + key (the WRITE grant; part = the whole object), no data."""
    READV = 8
    """Several READs in one frame (module docstring). A client asks each new connection with an empty
    READV first: a store that predates it answers UNKNOWN_OP and closes, and gets plain READs and WRITEs."""
    WRITEV = 9
    """Several WRITEs in one frame (module docstring)."""
    READ_KEY = 10
    """A speculative read by key, sent while the master lookup is under way (decision 0031). Payload:
    :data:`READ_KEY_REQUEST` (the longest object the client takes) then the key. The store answers OK with
    :data:`READ_KEY_META` (where the object it holds under that key lies, and its checksum) and the object's
    bytes, or a bare OBJECT_NOT_FOUND (it holds no such committed object in DRAM) / BUFFER_TOO_SMALL (longer
    than asked). The client counts the bytes only once the master's answer names the same segment, range
    and checksum; a store that predates the op answers UNKNOWN_OP and closes."""
    RDMA_WINDOWS = 24
    """On an RDMA control connection: grants in, one memory window (addr, rkey) per valid grant out, bound to
    the connection's QP over exactly the grant's range and access until it expires (docs/rdma.md)."""
    # Master RPCs (the lean path), same messages as the gRPC service.
    GET_CLUSTER_INFO = 64
    BATCH_PUT_START = 65
    BATCH_PUT_END = 66
    BATCH_PUT_REVOKE = 67
    BATCH_GET_REPLICAS = 68
    BATCH_EXISTS = 69
    BATCH_REMOVE = 70
    REMOVE_ALL = 71
    GET_STATS = 72
    PIN = 73
    REPORT_STORE_FAILURES = 90
    """A client could not connect to these stores' data planes (dead-store suspicion, master/suspicion.py)."""


# op -> (gRPC method name, request type, response type)
RPC_METHODS: dict[int, tuple[str, type, type]] = {
    Op.GET_CLUSTER_INFO: ("GetClusterInfo", pb.ClusterInfoRequest, pb.ClusterInfoResponse),
    Op.BATCH_PUT_START: ("BatchPutStart", pb.BatchPutStartRequest, pb.BatchPutStartResponse),
    Op.BATCH_PUT_END: ("BatchPutEnd", pb.BatchPutEndRequest, pb.BatchCodesResponse),
    Op.BATCH_PUT_REVOKE: ("BatchPutRevoke", pb.BatchPutRevokeRequest, pb.BatchCodesResponse),
    Op.BATCH_GET_REPLICAS: ("BatchGetReplicas", pb.BatchGetReplicasRequest, pb.BatchGetReplicasResponse),
    Op.BATCH_EXISTS: ("BatchExists", pb.BatchExistsRequest, pb.BatchExistsResponse),
    Op.BATCH_REMOVE: ("BatchRemove", pb.BatchRemoveRequest, pb.BatchCodesResponse),
    Op.REMOVE_ALL: ("RemoveAll", pb.RemoveAllRequest, pb.RemoveAllResponse),
    Op.GET_STATS: ("GetStats", pb.StatsRequest, pb.StatsResponse),
    Op.PIN: ("Pin", pb.PinRequest, pb.BatchCodesResponse),
    Op.REPORT_STORE_FAILURES: ("ReportStoreFailures", pb.ReportStoreFailuresRequest, pb.ReportStoreFailuresResponse),
}


class Header(NamedTuple):
    """A decoded header (a tuple: built on every master request, a frozen dataclass costs 3x more)."""

    op: int
    status: int
    req_id: int
    length: int


def pack_header(op: int, req_id: int, length: int, status: int = 0) -> bytes:
    return HEADER.pack(MAGIC, op, 0, status, req_id, length)


def unpack_header(raw: bytes | bytearray | memoryview) -> Header:
    magic, op, _flags, status, req_id, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"bad magic 0x{magic:08x}")
    return Header(op, status, req_id, length)


class TransferDesc(NamedTuple):
    """What one READ/WRITE request moves: a part of an object, under the object's grant."""

    grant: Grant
    checksum: int
    part_offset: int
    part_length: int

    def pack(self) -> bytes:
        g = self.grant
        return (
            DESC.pack(
                g.segment_id,
                g.offset,
                g.length,
                g.expiry_ms,
                self.checksum,
                self.part_offset,
                self.part_length,
                len(g.key),
                g.mac,
            )
            + g.key
        )


def unpack_desc(op: GrantOp, raw: bytes | bytearray | memoryview) -> tuple[TransferDesc, int]:
    """Parse a DESC + key from the start of ``raw``; returns the desc and the bytes consumed."""
    if len(raw) < DESC.size:
        raise KvPoolError(ErrorCode.BAD_FRAME, "truncated transfer descriptor")
    seg, off, length, expiry, csum, part_off, part_len, key_len, mac = DESC.unpack_from(raw)
    if key_len > MAX_KEY_BYTES or len(raw) < DESC.size + key_len:
        raise KvPoolError(ErrorCode.BAD_FRAME, f"bad key length {key_len}")
    key = bytes(raw[DESC.size : DESC.size + key_len])
    grant = Grant(op, seg, off, length, expiry, key, mac)
    return TransferDesc(grant, csum, part_off, part_len), DESC.size + key_len


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; a peer that closes early raises CONNECTION_FAILED."""
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise KvPoolError(ErrorCode.CONNECTION_FAILED, "connection closed by peer")
        view = view[n:]


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return buf


def recv_header(sock: socket.socket) -> Header:
    return unpack_header(recv_exact(sock, HEADER_SIZE))
