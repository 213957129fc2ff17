"""Same-node transfers through shared memory: the client maps the store's segment file and copies.

A store's segment is a file in /dev/shm (or hugetlbfs) that only the pool's user can open. A client on
the same node maps it once and moves bytes with memcpy — no data RPC. A READ is a copy out of the map
(the client still verifies the checksum and the lease, as for TCP). A WRITE is a copy into the map,
then one small RECORD frame per batch and store (pipelined) tells the store to add the objects to its
inventory, under the same WRITE grant the store would check for a TCP write.

Only DRAM replicas (tier 0) whose segment file exists on this machine are served; anything else falls
through to the next transport.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
from collections.abc import Sequence

from kvpool.common import envs
from kvpool.common.auth import MAX_HELLO_REPLY, client_handshake
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.grants import GrantOp
from kvpool.common.log import get_logger
from kvpool.proto import frames
from kvpool.transfer.base import CompletedBatch, Replica, TransferBatch, TransferRequest, Transport
from kvpool.transfer.memcopy import copy_into

log = get_logger(__name__)


class _Mapping:
    """One store segment file mapped read-write into this process."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = memoryview(self.map)
        self.size = size

    def close(self) -> None:
        self.view.release()
        self.map.close()


class ShmTransport(Transport):
    """memcpy to and from segments of stores on this node."""

    name = "shm"
    verifies_reads = True

    def __init__(self, node: str, token: bytes = b"") -> None:
        self._node = node
        self._token = token
        self._lock = threading.Lock()
        self._maps: dict[str, _Mapping | None] = {}  # path -> mapping (None: cannot be mapped here)
        self._record_socks: dict[str, socket.socket] = {}
        self._disabled = envs.KVPOOL_DISABLE_SHM.get()

    def can_reach(self, replica: Replica) -> bool:
        if self._disabled or replica.tier != 0 or replica.node != self._node or not replica.shm_path:
            return False
        mapping = self._mapping(replica.shm_path)
        return mapping is not None and replica.offset + replica.length <= mapping.size

    def _mapping(self, path: str) -> _Mapping | None:
        with self._lock:
            if path in self._maps:
                return self._maps[path]
            try:
                mapping: _Mapping | None = _Mapping(path)
            except OSError:
                mapping = None  # another machine with the same node name, or no permission: use TCP
            self._maps[path] = mapping
            return mapping

    def submit(self, requests: Sequence[TransferRequest], deadline: Deadline) -> TransferBatch:
        codes = [ErrorCode.OK] * len(requests)
        records: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            codes[i] = self._copy(request)
            if codes[i] == ErrorCode.OK and request.op == GrantOp.WRITE:
                records.setdefault(request.replica.tcp_endpoint, []).append(i)
        for endpoint, positions in records.items():
            for i, code in zip(
                positions, self._record(endpoint, [requests[i] for i in positions], deadline), strict=True
            ):
                codes[i] = code
        return CompletedBatch(codes)

    def _copy(self, request: TransferRequest) -> ErrorCode:
        replica = request.replica
        mapping = self._mapping(replica.shm_path)
        if mapping is None or replica.offset + replica.length > mapping.size:
            return ErrorCode.TRANSFER_FAILED
        if len(request.buffer) != replica.length:
            return ErrorCode.INVALID_ARGUMENT
        with mapping.view[replica.offset : replica.offset + replica.length] as window:
            if request.op == GrantOp.READ:
                copy_into(request.buffer, window)
            else:
                copy_into(window, request.buffer)
        if request.verify and request.op == GrantOp.READ:
            return request.check_landed()  # right after the copy, while the bytes are in cache
        return ErrorCode.OK

    def _record(self, endpoint: str, requests: list[TransferRequest], deadline: Deadline) -> list[ErrorCode]:
        """Pipeline one RECORD per written object to the store, then read the answers in order."""
        frames_out = []
        for n, request in enumerate(requests):
            desc = frames.TransferDesc(
                request.replica.grant(GrantOp.WRITE, request.key),
                request.write_checksum(),
                0,
                request.replica.length,
            ).pack()
            frames_out.append(frames.pack_header(frames.Op.RECORD, n, len(desc)) + desc)
        sock: socket.socket | None = None
        try:
            sock = self._checkout(endpoint, deadline)
            sock.settimeout(max(0.001, deadline.remaining() or 5.0))
            sock.sendall(b"".join(frames_out))
            codes = []
            for n in range(len(requests)):
                head = frames.recv_header(sock)
                if head.req_id != n or head.length:
                    raise KvPoolError(ErrorCode.BAD_FRAME, "RECORD answer out of order")
                codes.append(as_code(head.status))
            self._checkin(endpoint, sock)
            return codes
        except (OSError, KvPoolError) as exc:
            if sock is not None:
                sock.close()
            code = exc.code if isinstance(exc, KvPoolError) else ErrorCode.CONNECTION_FAILED
            log.warning("RECORD to %s failed: %s", endpoint, exc)
            return [code] * len(requests)

    def _checkout(self, endpoint: str, deadline: Deadline) -> socket.socket:
        """An idle RECORD connection to ``endpoint`` for this caller alone, or a new one."""
        with self._lock:
            sock = self._record_socks.pop(endpoint, None)
        if sock is not None:
            return sock
        host, _, port = endpoint.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=max(0.001, deadline.remaining() or 5.0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._token:
            try:
                client_handshake(self._token, lambda body: _hello(sock, body), f"store {endpoint}")
            except (OSError, KvPoolError):
                sock.close()
                raise
        return sock

    def _checkin(self, endpoint: str, sock: socket.socket) -> None:
        with self._lock:
            if endpoint not in self._record_socks:
                self._record_socks[endpoint] = sock
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
            socks, self._record_socks = self._record_socks, {}
        for mapping in maps.values():
            if mapping is not None:
                mapping.close()
        for sock in socks.values():
            sock.close()


def _hello(sock: socket.socket, body: bytes) -> tuple[int, bytes]:
    """One HELLO of the token's challenge-response on a blocking RECORD connection."""
    sock.sendall(frames.pack_header(frames.Op.HELLO, 0, len(body)) + body)
    head = frames.recv_header(sock)
    if head.op != frames.Op.HELLO or head.length > MAX_HELLO_REPLY:
        raise KvPoolError(ErrorCode.BAD_FRAME, "bad HELLO reply")
    return head.status, bytes(frames.recv_exact(sock, head.length)) if head.length else b""
