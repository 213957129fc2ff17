"""Speculative reads by key: a first read in the time of one round trip (decision 0031).

A read of an object this client holds no descriptor of (no live lease, no hint) is two round trips in
sequence: the master says where the object is, then the store sends it. When the client can tell which
store holds the object before the master answers - today: the cluster's objects have all come from one
store over TCP, the single-store deployment - it sends a READ_KEY to that store *before* it sends the
master lookup, and receives the store's answer after the master's. The store answers with the object it
holds under that key, if any (store/read_by_key.py), and says where it lay.

The bytes count only when the master's answer confirms them: the key is readable (a live lease was
granted), of the same size and checksum, with a DRAM replica on the very segment, offset and length the
store read; and the bytes hash to that checksum. Anything else - the store holds no such object, a stale
copy, a range reused between the two answers, a master that says miss, a store that does not answer -
discards them, and the ordinary read runs with the master's answer, as if nothing had been sent.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from kvpool.common.auth import MAX_HELLO_REPLY, client_handshake
from kvpool.common.checksum import checksum
from kvpool.common.clock import Clock, Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger
from kvpool.proto.frames import HEADER, HEADER_SIZE, MAGIC, MAX_KEY_BYTES, READ_KEY_META, READ_KEY_REQUEST, Op
from kvpool.transfer.base import Replica
from kvpool.transfer.tcp_socket import parse_endpoint, set_io_timeout, tune_socket

logger = get_logger(__name__)

_STORE_SEEN_S = 60.0
"""A store named by a master answer within this long counts as one the cluster's objects live on."""
_COOLDOWN_S = 5.0
"""After a store could not be reached (or refused the op), no speculation goes to it for this long."""
_IDLE_PER_STORE = 8


class Answer(NamedTuple):
    """What a store sent for a READ_KEY: where the object lay, its checksum, and how many bytes landed."""

    segment_id: int
    offset: int
    length: int
    checksum: int


class Sent(NamedTuple):
    """READ_KEYs on their way: the connection they went out on, where to, and their request ids
    (``first_req_id`` and the ``entries - 1`` after it, in order)."""

    sock: socket.socket
    endpoint: str
    first_req_id: int
    entries: int


class MasterAnswer(Protocol):
    """The fields of the master's answer for the key that confirm (or refute) a speculative read."""

    @property
    def code(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def checksum(self) -> int: ...
    @property
    def lease_expiry_ms(self) -> int: ...
    @property
    def replicas(self) -> tuple[Replica, ...]: ...


class SpeculativeReads:
    """The client's speculative reads by key: which store to ask, its connections, and the check that
    makes the bytes count. Thread-safe: each read holds a connection of its own."""

    def __init__(self, max_bytes: int, clock: Clock, token: bytes = b"", connect_timeout_s: float = 1.0) -> None:
        self.max_bytes = max_bytes
        """The longest object read by key; 0 turns speculation off."""
        self._clock = clock
        self._token = token
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # TCP endpoint -> monotonic time a master answer last named it
        self._cooling: dict[str, float] = {}  # endpoint -> monotonic time speculation may resume
        self._idle: dict[str, list[socket.socket]] = {}
        self._req_ids = 0
        self.confirmed = 0
        self.discarded = 0

    # ------------------------------------------------------------------ which store
    def learn(self, replicas: Sequence[Replica]) -> None:
        """A master answer named these DRAM replicas, read over TCP: the stores objects live on."""
        if not replicas:
            return
        now = time.monotonic()
        with self._lock:
            for replica in replicas:
                self._seen[replica.tcp_endpoint] = now

    def target(self) -> str | None:
        """The store to ask: the only one recent answers named, unless it is cooling down after a failure."""
        if not self.max_bytes:
            return None
        now = time.monotonic()
        with self._lock:
            for endpoint in [e for e, seen in self._seen.items() if now - seen > _STORE_SEEN_S]:
                del self._seen[endpoint]
            if len(self._seen) != 1:
                return None
            (endpoint,) = self._seen
            until = self._cooling.get(endpoint)
            if until is not None:
                if now < until:
                    return None
                del self._cooling[endpoint]
        return endpoint

    # ------------------------------------------------------------------ the request
    def send(self, keys: Sequence[str], max_lengths: Sequence[int], deadline: Deadline) -> Sent | None:
        """Send a READ_KEY for each key (each at most its ``max_lengths`` bytes) to the expected store, in one
        send; None when there is none to ask or they could not be sent (the reads then go the ordinary way)."""
        endpoint = self.target()
        raw_keys = [key.encode() for key in keys]
        if endpoint is None or any(len(k) > MAX_KEY_BYTES for k in raw_keys):
            return None
        sock = self._checkout(endpoint, deadline)
        if sock is None:
            return None
        with self._lock:
            first = self._req_ids + 1
            self._req_ids += len(raw_keys)
        frames = []
        for req_id, (key, max_length) in enumerate(zip(raw_keys, max_lengths, strict=True), first):
            length = READ_KEY_REQUEST.size + len(key)
            frames.append(
                HEADER.pack(MAGIC, Op.READ_KEY, 0, 0, req_id, length)
                + READ_KEY_REQUEST.pack(min(max_length, self.max_bytes))
                + key
            )
        try:
            set_io_timeout(sock, _remaining(deadline, self._connect_timeout_s))
            sock.sendall(b"".join(frames))
        except OSError:
            self._broken(sock, endpoint)
            return None
        return Sent(sock, endpoint, first, len(raw_keys))

    def finish(
        self, sent: Sent, answers: Sequence[MasterAnswer], views: Sequence[memoryview], deadline: Deadline
    ) -> list[int | None]:
        """Receive the store's answers into ``views`` and keep each only if the master's answer for its key
        confirms it: per key, the object's size, or None (its bytes are discarded; its view may hold them,
        to be overwritten by the ordinary read)."""
        got = self._receive(sent, views, deadline)
        sizes: list[int | None] = []
        for landed, answer, view in zip(got, answers, views, strict=True):
            kept = (
                landed is not None
                and self._confirms(landed, answer)
                and checksum(view[: landed.length]) == answer.checksum
            )
            sizes.append(landed.length if landed is not None and kept else None)
        confirmed = sum(1 for size in sizes if size is not None)
        with self._lock:
            self.confirmed += confirmed
            self.discarded += len(sizes) - confirmed
        return sizes

    def _receive(self, sent: Sent, views: Sequence[memoryview], deadline: Deadline) -> list[Answer | None]:
        """The store's answers, in order, each one's bytes landed at the start of its view; None where it
        sent none. The connection goes back to the pool only when every answer was read to its end."""
        sock = sent.sock
        got: list[Answer | None] = []
        try:
            set_io_timeout(sock, _remaining(deadline, self._connect_timeout_s))
            for req_id, view in enumerate(views, sent.first_req_id):
                got.append(_receive_one(sock, req_id, view))
        except (OSError, KvPoolError) as exc:
            logger.debug("speculative read from %s failed: %s", sent.endpoint, exc)
            self._broken(sock, sent.endpoint)
            return [None] * len(views)
        self._checkin(sent)
        return got

    def _confirms(self, got: Answer, answer: MasterAnswer) -> bool:
        """Whether the master's answer names exactly the object the store sent, under a live lease."""
        if answer.code != ErrorCode.OK or answer.size != got.length or answer.checksum != got.checksum:
            return False
        if self._clock.wall_ms() >= answer.lease_expiry_ms:
            return False
        return any(
            r.tier == 0 and r.segment_id == got.segment_id and r.offset == got.offset and r.length == got.length
            for r in answer.replicas
        )

    # ------------------------------------------------------------------ connections
    def _checkout(self, endpoint: str, deadline: Deadline) -> socket.socket | None:
        with self._lock:
            idle = self._idle.get(endpoint)
            if idle:
                return idle.pop()
        try:
            return self._connect(endpoint, deadline)
        except (OSError, KvPoolError) as exc:
            logger.debug("speculative reads: cannot reach %s: %s", endpoint, exc)
            self._cool(endpoint)
            return None

    def _connect(self, endpoint: str, deadline: Deadline) -> socket.socket:
        """A fresh connection to a store's data plane, the cluster token proved when there is one."""
        timeout = _remaining(deadline, self._connect_timeout_s)
        sock = socket.create_connection(parse_endpoint(endpoint), timeout=max(timeout, 0.001))
        try:
            sock.settimeout(None)
            tune_socket(sock)
            set_io_timeout(sock, timeout)
            if self._token:
                client_handshake(self._token, lambda body: _hello(sock, body), f"store {endpoint}")
        except BaseException:
            sock.close()
            raise
        return sock

    def _checkin(self, sent: Sent) -> None:
        with self._lock:
            idle = self._idle.setdefault(sent.endpoint, [])
            if len(idle) < _IDLE_PER_STORE:
                idle.append(sent.sock)
                return
        sent.sock.close()

    def _broken(self, sock: socket.socket, endpoint: str) -> None:
        sock.close()
        self._cool(endpoint)

    def _cool(self, endpoint: str) -> None:
        with self._lock:
            self._cooling[endpoint] = time.monotonic() + _COOLDOWN_S

    def close(self) -> None:
        with self._lock:
            idle = [s for socks in self._idle.values() for s in socks]
            self._idle.clear()
        for sock in idle:
            sock.close()


def _receive_one(sock: socket.socket, req_id: int, view: memoryview) -> Answer | None:
    """One READ_KEY answer: its bytes landed at the start of ``view``, or None for a bare refusal."""
    magic, op, _flags, status, answered, length = HEADER.unpack(_recv_exact(sock, HEADER_SIZE))
    if magic != MAGIC or answered != req_id:
        raise KvPoolError(ErrorCode.BAD_FRAME, "READ_KEY answer out of step")
    if status != ErrorCode.OK:
        if op != Op.READ_KEY or status == ErrorCode.UNKNOWN_OP:  # an older store, or one closing on us
            raise KvPoolError(ErrorCode.UNKNOWN_OP, f"store refused READ_KEY: {status}")
        if length:
            raise KvPoolError(ErrorCode.BAD_FRAME, "READ_KEY refusal with a payload")
        return None
    got = Answer(*READ_KEY_META.unpack(_recv_exact(sock, READ_KEY_META.size)))
    if length != READ_KEY_META.size + got.length or got.length > len(view):
        raise KvPoolError(ErrorCode.BAD_FRAME, f"READ_KEY answer of {length} bytes for {got.length}")
    _recv_exact_into(sock, view[: got.length])
    return got


def _remaining(deadline: Deadline, cap: float) -> float:
    remaining = deadline.remaining()
    return cap if remaining is None else max(min(remaining, cap), 0.001)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view, len(view), socket.MSG_WAITALL)
        if got == 0:
            raise KvPoolError(ErrorCode.CONNECTION_FAILED, "store closed the connection")
        view = view[got:]


def _hello(sock: socket.socket, body: bytes) -> tuple[int, bytes]:
    """One HELLO exchange of the token's challenge-response on a fresh connection."""
    sock.sendall(HEADER.pack(MAGIC, Op.HELLO, 0, 0, 0, len(body)) + body)
    magic, op, _flags, status, _req_id, length = HEADER.unpack(_recv_exact(sock, HEADER_SIZE))
    if magic != MAGIC or op != Op.HELLO or length > MAX_HELLO_REPLY:
        raise KvPoolError(ErrorCode.BAD_FRAME, "bad HELLO reply")
    return status, _recv_exact(sock, length) if length else b""
