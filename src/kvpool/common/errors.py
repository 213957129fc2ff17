"""One error-code enum for the whole system, and the exception that carries it.

Codes are negative integers grouped in ranges per subsystem (as in Mooncake's ``types.h``), so that the
batch APIs can return "bytes read (>= 0) or a negative code" in one ``int`` the way Mooncake's Python API
does, and engines port without translating conventions.

Exception tree::

    Exception
    └── KvPoolError(code, message)        every failure a caller can see carries an ErrorCode

Batch calls never raise for a per-key failure: they return one code per key. ``KvPoolError`` is for
whole-call failures (bad arguments, no master reachable before the deadline, ...).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum


class ErrorCode(IntEnum):
    """All error codes. 0 is success; every failure is negative and belongs to one range."""

    OK = 0

    # -1 .. -99: general
    INTERNAL = -1
    """A bug or an unexpected state; the message says where."""
    INVALID_ARGUMENT = -2
    """The caller passed something malformed (negative size, wrong types, mismatched list lengths)."""
    TIMEOUT = -3
    """The call's deadline passed before it completed."""
    UNAVAILABLE = -4
    """The peer (master or store) cannot be reached now; the client is reconnecting."""
    CANCELLED = -5
    NOT_SUPPORTED = -6
    SHUTTING_DOWN = -7

    # -100 .. -199: keys and objects
    OBJECT_NOT_FOUND = -100
    OBJECT_ALREADY_EXISTS = -101
    """Values are immutable: a put of an existing key is a no-op (the client maps this to success)."""
    OBJECT_NOT_READY = -102
    """The object is still being written (PROCESSING)."""
    OBJECT_HAS_LEASE = -103
    """A read lease protects the object; remove it with force=True or retry after the lease."""
    LEASE_EXPIRED = -104
    """A read completed after its lease ended; the bytes were discarded."""
    OBJECT_PINNED = -105
    KEY_TOO_LONG = -106
    INVALID_KEY = -107
    VALUE_TOO_LARGE = -108
    BUFFER_TOO_SMALL = -109
    """The destination buffer is smaller than the object."""
    ILLEGAL_CLIENT = -110
    """Only the client that started a put may end or revoke it."""
    NO_PUT_IN_PROGRESS = -111

    # -200 .. -299: allocation
    NO_SPACE = -200
    """No segment can hold the object even after eviction."""
    DEMOTION_BACKLOG = -230
    """DRAM is full of objects being demoted to an SSD tier: retry shortly (the client does, until its
    deadline). The SSD tier's backpressure (docs/ssd-tier.md)."""

    # -300 .. -399: segments and membership
    SEGMENT_NOT_FOUND = -300
    SEGMENT_ALREADY_EXISTS = -301
    SEGMENT_NOT_WRITABLE = -302
    """The segment is DRAINING or DRAINED: readable, but it takes no new allocations."""
    NEED_REMOUNT = -303
    """The master does not know this store (restart, failover, expiry): it must mount again."""
    STORE_NOT_FOUND = -304

    # -400 .. -499: transfer / data plane
    TRANSFER_FAILED = -400
    CHECKSUM_MISMATCH = -401
    OUT_OF_BOUNDS = -402
    """A data-plane request named a range outside the segment or outside its grant."""
    BAD_FRAME = -403
    """A malformed frame on a data or RPC connection; that connection is closed."""
    AUTH_FAILED = -404
    """The request's grant or token does not verify."""
    GRANT_EXPIRED = -405
    CONNECTION_FAILED = -406
    UNKNOWN_OP = -407

    # -500 .. -599: RPC and high availability
    RPC_FAILED = -500
    NOT_LEADER = -501
    """This master is a follower; the response names the leader."""
    STALE_VIEW = -502
    """An answer came from a deposed leader (older view); it is refused."""
    ETCD_ERROR = -503
    LEADER_WARMING_UP = -504

    # -600 .. -699: limits
    BATCH_TOO_LARGE = -600
    TOO_MANY_CONNECTIONS = -601
    TOO_MANY_BYTES_IN_FLIGHT = -602

    # -700 .. -799: operations (drain, scale)
    JOB_NOT_FOUND = -700
    DRAIN_FAILED = -701


def strerror(code: int) -> str:
    """A human name for any code, including unknown ones (they come from newer peers)."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"UNKNOWN_ERROR({code})"


def as_code(value: int) -> ErrorCode:
    """Map an int from the wire to an ErrorCode; unknown values become INTERNAL."""
    # A dict lookup, not ErrorCode(value): the Enum call costs ~2 us, paid per key of every batch.
    return _BY_VALUE.get(value, ErrorCode.INTERNAL)


_BY_VALUE: dict[int, ErrorCode] = {int(code): code for code in ErrorCode}


def batch_failure(what: str, codes: Iterable[int]) -> KvPoolError:
    """The error for a batch call that had to succeed and did not: the first failure's code, and every
    distinct failure named (a tool prints it and exits 2, instead of a traceback)."""
    failed = list(dict.fromkeys(int(c) for c in codes if c < 0))  # distinct, in the order they came
    code = as_code(failed[0]) if failed else ErrorCode.INTERNAL
    return KvPoolError(code, f"{what}: {', '.join(strerror(c) for c in failed) or 'unexpected results'}")


class KvPoolError(Exception):
    """A whole-call failure with its ErrorCode."""

    def __init__(self, code: ErrorCode, message: str = "") -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}" if message else code.name)
