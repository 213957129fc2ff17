"""Fuzzing the store's data-plane frame parser against a real DataPlaneServer (in-process, real sockets).

Each example sends one connection's worth of frames - valid ones (HELLO, PING, STORE_INFO, READ, READV,
WRITE and WRITEV under real grants), mutated ones (bit flips, edge-value fields, truncations, splices)
and random bytes - then closes its side and drains the replies. After every example:

* the server still serves (a fresh connection gets a PING answered),
* ``statistics().connections`` returns to 0 (no connection or thread leaked),
* every byte of the segment outside the ranges granted for WRITE still holds the fill pattern (nothing
  was read or written outside an allocated range).

Two servers run: one open, one requiring the cluster token (so HELLO and its refusals are fuzzed too).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.common.auth import HANDSHAKE_TAG, TokenChecker, client_handshake
from kvpool.common.grants import Grant, GrantOp, make_grant, new_secret
from kvpool.proto.frames import DESC, HEADER, HEADER_SIZE, MAGIC, MAX_VECTOR_ENTRIES, VECTOR_COUNT, Op, TransferDesc
from kvpool.store.dataplane import DataPlaneServer
from kvpool.store.inventory import Inventory
from kvpool.store.limits import ClientLimits
from kvpool.store.segment import ShmSegment
from tests.fuzz.fuzzlib import corpus, examples, mutated
from tests.support.wait import wait_for

SEG_SIZE = 4 << 20
TOKEN = b"fuzz-token-0123456789"
# The only ranges any example may write: (offset, length).
WRITE_RANGES = [(64 << 10, 16 << 10), (1 << 20, 100), (SEG_SIZE - 4096, 4096)]
READ_RANGES = [(0, 4096), (2 << 20, 256 << 10)]


@dataclass
class Target:
    server: DataPlaneServer
    segment: ShmSegment
    secret: bytes
    pattern: np.ndarray
    token: bytes
    grants: list[Grant]

    def outside_writes_intact(self) -> None:
        actual = np.frombuffer(self.segment.view, dtype=np.uint8)
        mask = np.ones(SEG_SIZE, dtype=bool)
        for off, n in WRITE_RANGES:
            mask[off : off + n] = False
        bad = np.nonzero((actual != self.pattern) & mask)[0]
        assert bad.size == 0, f"{bad.size} bytes changed outside the granted WRITE ranges, first at {bad[0]}"


def _make_target(tmp: Path, token: bytes) -> Target:
    seg = ShmSegment.create(str(tmp), f"fuzz-{os.getpid()}-{time.monotonic_ns()}", SEG_SIZE)
    pattern = np.random.default_rng(11).integers(0, 256, SEG_SIZE, dtype=np.uint8)
    np.frombuffer(seg.view, dtype=np.uint8)[:] = pattern
    secret = new_secret()
    server = DataPlaneServer(
        "127.0.0.1",
        0,
        {seg.id: seg},
        {seg.id: secret},
        Inventory(),
        stall_timeout_s=2.0,
        auth=TokenChecker(token),
        limits=ClientLimits(64, 64 << 20),
    )
    server.start()
    expiry = time.time_ns() // 1_000_000 + 3_600_000
    grants = [make_grant(secret, GrantOp.WRITE, seg.id, off, n, expiry, f"w{off}".encode()) for off, n in WRITE_RANGES]
    grants += [make_grant(secret, GrantOp.READ, seg.id, off, n, expiry, f"r{off}".encode()) for off, n in READ_RANGES]
    grants.append(make_grant(secret, GrantOp.WRITE, seg.id, 8192, 4096, 1, b"expired"))  # long expired
    return Target(server, seg, secret, pattern, token, grants)


@pytest.fixture(scope="module", params=[b"", TOKEN], ids=["open", "token"])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    t = _make_target(tmp_path_factory.mktemp("dp"), request.param)
    try:
        yield t
    finally:
        t.server.stop()
        assert t.server.statistics().connections == 0
        t.segment.close()


# ---------------------------------------------------------------------- frames
def frame(op: int, payload: bytes = b"", req_id: int = 1) -> bytes:
    return HEADER.pack(MAGIC, op, 0, 0, req_id, len(payload)) + payload


@st.composite
def granted_part(draw: st.DrawFn, t: Target) -> bytes:
    """DESC + key for a part of one of the target's grants."""
    grant = draw(st.sampled_from(t.grants))
    part_off = draw(st.integers(0, grant.length))
    part_len = draw(st.integers(0, grant.length - part_off))
    return TransferDesc(grant, 0, part_off, part_len).pack()


@st.composite
def valid_frame(draw: st.DrawFn, t: Target) -> bytes:
    kind = draw(st.sampled_from(["hello", "bad_hello", "ping", "info", "read", "readv", "write", "writev", "record"]))
    if kind == "hello":  # a challenge, or the token in clear (a pre-0025 client)
        return frame(Op.HELLO, draw(st.sampled_from([HANDSHAKE_TAG + b"\x01" + bytes(32), t.token])))
    if kind == "bad_hello":
        return frame(Op.HELLO, draw(st.binary(max_size=64)))
    if kind == "ping":
        return frame(Op.PING)
    if kind == "info":
        return frame(Op.STORE_INFO)
    if kind == "readv":  # READ grants, WRITE grants (refused) and expired ones, several to a frame
        entries = draw(st.lists(granted_part(t), min_size=1, max_size=MAX_VECTOR_ENTRIES))
        return frame(Op.READV, VECTOR_COUNT.pack(len(entries)) + b"".join(entries))
    if kind == "writev":  # only the WRITE grants' ranges may change, whatever the mix
        entries = draw(st.lists(granted_part(t), min_size=1, max_size=MAX_VECTOR_ENTRIES))
        data = b"".join(draw(st.binary(min_size=n, max_size=n)) for n in (DESC.unpack_from(e)[6] for e in entries))
        return frame(Op.WRITEV, VECTOR_COUNT.pack(len(entries)) + b"".join(entries) + data)
    desc = draw(granted_part(t))
    part_len = DESC.unpack_from(desc)[6]
    if kind == "read":
        return frame(Op.READ, desc)
    if kind == "record":  # a same-node client's "I memcpy'd it": no bytes move, the inventory may change
        return frame(Op.RECORD, desc)
    return frame(Op.WRITE, desc + draw(st.binary(min_size=part_len, max_size=part_len)))


@st.composite
def conversation(draw: st.DrawFn, t: Target) -> tuple[bool, list[bytes]]:
    """What one connection sends: usually the token's handshake first (so the rest reaches the parser),
    then 1..5 frames, each valid, mutated or random."""
    authenticate = draw(st.booleans()) or draw(st.booleans())
    frames: list[bytes] = []
    for _ in range(draw(st.integers(1, 5))):
        how = draw(st.sampled_from(["valid", "mutated", "mutated", "random"]))
        if how == "random":
            frames.append(draw(st.binary(min_size=1, max_size=256)))
        else:
            one = draw(valid_frame(t))
            frames.append(one if how == "valid" else draw(mutated(one)))
    return authenticate, frames


def handshake(sock: socket.socket, token: bytes) -> None:
    """The token's challenge-response (common/auth.py) on a raw connection."""

    def exchange(payload: bytes) -> tuple[int, bytes]:
        sock.sendall(frame(Op.HELLO, payload, 7))
        _magic, _op, _f, status, _rid, length = HEADER.unpack(_recv(sock, HEADER_SIZE))
        return status, _recv(sock, length) if length else b""

    client_handshake(token, exchange, "store")


def converse(port: int, frames: list[bytes], token: bytes = b"") -> None:
    """Prove ``token`` if given, send everything, close our side, read until the server closes (its replies
    are not judged here)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        if token:
            handshake(sock, token)
        try:
            for data in frames:
                sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 20):
                pass
        except OSError:
            pass  # the server closed on a malformed frame (reset, broken pipe, ENOTCONN): expected


def still_serves(t: Target) -> None:
    with socket.create_connection(("127.0.0.1", t.server.port), timeout=10) as sock:
        if t.token:
            handshake(sock, t.token)
        sock.sendall(frame(Op.PING, b"", 8))
        magic, op, _f, status, req_id, length = HEADER.unpack(_recv(sock, HEADER_SIZE))
        assert (magic, op, status, req_id, length) == (MAGIC, Op.PING, 0, 8, 0)


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the server closed a healthy connection"
        out += chunk
    return out


def check_invariants(t: Target) -> None:
    still_serves(t)
    wait_for(lambda: t.server.statistics().connections == 0, 10.0, "every connection to close")
    t.outside_writes_intact()


# ---------------------------------------------------------------------- the fuzzers
@examples(200)
@given(data=st.data())
def test_fuzz_frames(target: Target, data: st.DataObject) -> None:
    authenticate, frames = data.draw(conversation(target))
    converse(target.server.port, frames, target.token if authenticate else b"")
    check_invariants(target)


@examples(60)
@given(blob=st.binary(min_size=1, max_size=4096))
def test_fuzz_random_bytes(target: Target, blob: bytes) -> None:
    converse(target.server.port, [blob])
    check_invariants(target)


@pytest.mark.parametrize(("name", "blob"), corpus("dataplane"), ids=[n for n, _ in corpus("dataplane")])
def test_corpus(target: Target, name: str, blob: bytes) -> None:
    converse(target.server.port, [blob])
    check_invariants(target)


def test_refusals_are_counted_when_a_token_is_required(target: Target) -> None:
    if not target.token:
        pytest.skip("the open server requires no token")
    before = target.server.auth.refused_by_plane.get("data", 0)
    converse(target.server.port, [frame(Op.PING)])  # no HELLO
    converse(target.server.port, [frame(Op.HELLO, b"wrong")])  # not even the handshake's version
    wait_for(lambda: target.server.auth.refused_by_plane.get("data", 0) == before + 2, 5.0, "2 refusals")
    check_invariants(target)
