"""Data-plane grants: the master's signature on "this peer may READ/WRITE this range until then".

Every data-plane request carries a grant. The store verifies it with the per-segment secret that it
gave the master when it mounted, so no peer can read or overwrite memory by guessing an address
(a known weakness of Mooncake's TCP path), a write can only land inside a range the master
allocated for that key, and a read lease is enforced on the store as well as on the client.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from enum import IntEnum
from typing import NamedTuple

MAC_BYTES = 16
SECRET_BYTES = 32
_GRANT_HEAD = struct.Struct("<BQQQQ")  # op, segment_id, offset, length, expiry_ms


class GrantOp(IntEnum):
    READ = 1
    WRITE = 2


class Grant(NamedTuple):
    """A signed permission for one object range on one segment (a tuple: the store builds one per
    request, and a frozen dataclass costs more to build: docs/decisions/0010)."""

    op: GrantOp
    segment_id: int
    offset: int
    length: int
    expiry_ms: int
    key: bytes
    mac: bytes


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


def sign(secret: bytes, op: GrantOp, segment_id: int, offset: int, length: int, expiry_ms: int, key: bytes) -> bytes:
    body = _GRANT_HEAD.pack(op, segment_id, offset, length, expiry_ms) + key
    return hashlib.blake2b(body, key=secret, digest_size=MAC_BYTES).digest()


def make_grant(
    secret: bytes, op: GrantOp, segment_id: int, offset: int, length: int, expiry_ms: int, key: bytes
) -> Grant:
    return Grant(
        op,
        segment_id,
        offset,
        length,
        expiry_ms,
        key,
        sign(secret, op, segment_id, offset, length, expiry_ms, key),
    )


def verify(secret: bytes, grant: Grant) -> bool:
    """Constant-time check of the grant's signature (expiry is checked by the caller's clock)."""
    expected = sign(secret, grant.op, grant.segment_id, grant.offset, grant.length, grant.expiry_ms, grant.key)
    return hmac.compare_digest(expected, grant.mac)
