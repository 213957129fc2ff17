"""The data plane's object ops: READ, READ_KEY, READV, WRITE and WRITEV of granted ranges (sendfile or
vectored sends of the segment, SSD-tier reads, landing WRITE parts and recording them in the inventory),
and the checks every one of them passes first (segment, MAC, bounds, expiry or revalidation, the client's
bytes in flight); the order of the checks is in dataplane.py's docstring.

A mixin of ``DataPlaneServer`` (dataplane.py), not a separate object: its connection loop calls these
methods, which work on the server's segments, secrets, tiers, inventory, limits and clock. The attributes
they use are declared below and assigned by ``DataPlaneServer.__init__``.
"""

from __future__ import annotations

import socket
from typing import Any

from kvpool.common.clock import Clock
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import GrantOp, verify
from kvpool.common.log import get_logger
from kvpool.proto.frames import (
    DESC,
    FLAG_FROM_PAGES,
    HEADER,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_VECTOR_DESCS,
    VECTOR_MAX_PART,
    Op,
    TransferDesc,
    vector_codes,
)
from kvpool.store.dataplane_conn import (
    _DESC_KEY_LEN,
    _DESC_PART_LENGTH,
    _Close,
    _Conn,
    _ConnStats,
    _desc,
    _flush,
    _hold,
    _Payload,
    _take_held,
)
from kvpool.store.inventory import Inventory
from kvpool.store.limits import ClientLimits
from kvpool.store.read_by_key import ReadByKey
from kvpool.store.segment import ShmSegment
from kvpool.store.ssd import SsdTier
from kvpool.store.tiering import read_tier_part, serve_tier_read
from kvpool.transfer.tcp_socket import (
    FrameReader,
    send_all,
    send_vectored,
    sendfile_all,
    spin_window,
)

logger = get_logger(__name__)

_SENDFILE_MIN_BYTES = 128 << 10
"""With ``read_sendfile``, READ parts at least this long are sent with sendfile (when the segment's file
system allows it); a smaller one leaves sooner as one sendmsg than as a header and a sendfile."""
_MAX_READ_PAYLOAD = DESC.size + MAX_KEY_BYTES


class DataOpsMixin:
    """The object ops and their checks (see the module docstring)."""

    _clock: Clock
    _inventory: Inventory
    _segments: dict[int, ShmSegment]
    _secrets: dict[int, bytes]
    _max_part: int
    _tiers: dict[int, tuple[SsdTier, bytes]]
    _no_sendfile: set[int]
    _read_sendfile: bool
    _spin_s: float
    limits: ClientLimits
    read_by_key: ReadByKey

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
                _flush(conn)
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
                start = desc.grant.offset + desc.part_offset
                dest = seg.view[start : start + desc.part_length]
                landing.append((desc, dest))
                dests.append(dest)
            # What the entries overwrite is dropped before any byte lands; one inventory call for the frame.
            self._inventory.begin_writes([_object_of(desc) for desc, _ in landing])
            reader.read_into_many(dests)
        finally:
            for desc, dest in landing:
                dest.release()
                self.limits.release(conn.client, desc.part_length)
        if landing:
            self._inventory.record_parts(
                [(*_object_of(desc), desc.part_offset, desc.part_length) for desc, _ in landing]
            )
            conn.stats.bytes_written += sum([desc.part_length for desc, _ in landing])
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


def _object_of(desc: TransferDesc) -> tuple[int, int, int, bytes, int]:
    """(segment_id, offset, length, key, checksum) of the object a WRITE part belongs to: the inventory's key."""
    g = desc.grant
    return g.segment_id, g.offset, g.length, g.key, desc.checksum
