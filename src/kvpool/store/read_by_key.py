"""The store's side of a speculative read by key (READ_KEY, decision 0031).

A client that has no descriptor of an object asks the master where it is and, at the same time, asks the
store it expects to hold it for the object by key. This store answers with the object only when its
inventory holds a committed object under exactly that key on a DRAM segment it serves - every byte
written, nothing begun over it since - and it fits the client's buffer. The answer names where the bytes
came from (segment, offset, length) and the checksum they were written with: the client counts them only
once the master's answer names the same object, and checks the bytes against that checksum as on every
read. Nothing outside a whole committed object is ever sent, and never without the cluster token (the
connection proved it, as for every op).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvpool.common.errors import ErrorCode
from kvpool.proto.frames import HEADER, MAGIC, MAX_KEY_BYTES, READ_KEY_META, READ_KEY_REQUEST, Op
from kvpool.store.inventory import Inventory
from kvpool.store.limits import ClientLimits
from kvpool.store.segment import ShmSegment
from kvpool.transfer.tcp_socket import FrameReader, send_all


@dataclass
class ReadByKeyStats:
    served: int = 0
    """Objects sent in answer to a READ_KEY."""
    not_held: int = 0
    """READ_KEYs answered OBJECT_NOT_FOUND or BUFFER_TOO_SMALL (the client then reads as usual)."""


class ReadByKey:
    """Serves READ_KEY frames of one data plane from its inventory and segments."""

    def __init__(
        self,
        inventory: Inventory,
        segments: Callable[[], Mapping[int, ShmSegment]],
        limits: ClientLimits,
        enabled: bool = True,
    ) -> None:
        self._inventory = inventory
        self._segments = segments
        self._limits = limits
        self.enabled = enabled
        """False: every READ_KEY is answered OBJECT_NOT_FOUND (the client reads through the master)."""
        self._lock = threading.Lock()
        self._stats = ReadByKeyStats()

    def statistics(self) -> ReadByKeyStats:
        with self._lock:
            return ReadByKeyStats(self._stats.served, self._stats.not_held)

    def serve(
        self,
        sock: socket.socket,
        client: str,
        take_held: Callable[[], bytes],
        reader: FrameReader,
        req_id: int,
        length: int,
    ) -> tuple[ErrorCode, int]:
        """Answer one READ_KEY whose header said ``length`` payload bytes. Returns (OK, bytes sent) when it
        sent the object (after the ``take_held`` replies), else the code of the bare reply the caller owes:
        BAD_FRAME means the frame was malformed and the connection must close."""
        if not READ_KEY_REQUEST.size < length <= READ_KEY_REQUEST.size + MAX_KEY_BYTES:
            return ErrorCode.BAD_FRAME, 0
        raw = reader.read(length)
        (max_length,) = READ_KEY_REQUEST.unpack_from(raw)
        key = bytes(raw[READ_KEY_REQUEST.size :])
        segments = self._segments()
        entry = self._inventory.find(key, segments) if self.enabled else None
        code = ErrorCode.OK
        if entry is None:
            code = ErrorCode.OBJECT_NOT_FOUND
        elif entry.length > max_length:
            code = ErrorCode.BUFFER_TOO_SMALL
        elif not self._limits.reserve(client, entry.length):
            code = ErrorCode.TOO_MANY_BYTES_IN_FLIGHT
        if entry is None or code != ErrorCode.OK:
            with self._lock:
                self._stats.not_held += 1
            return code, 0
        try:
            meta = READ_KEY_META.pack(entry.segment_id, entry.offset, entry.length, entry.checksum)
            header = take_held() + HEADER.pack(MAGIC, Op.READ_KEY, 0, 0, req_id, len(meta) + entry.length) + meta
            seg = segments[entry.segment_id]
            data = seg.view[entry.offset : entry.offset + entry.length]
            try:
                send_all(sock, header, data)
            finally:
                data.release()
        finally:
            self._limits.release(client, entry.length)
        with self._lock:
            self._stats.served += 1
        return ErrorCode.OK, entry.length
