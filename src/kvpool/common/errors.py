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
    AUTH_VERSION_MISMATCH = -471
    """The peer speaks another version of the framed-connection handshake (decision 0025): upgrade it."""

    # -500 .. -599: RPC and high availability
    RPC_FAILED = -500
    NOT_LEADER = -501
    """This master is a follower; the response names the leader."""
    STALE_VIEW = -502
    """An answer came from a deposed leader (older view); it is refused."""
    ETCD_ERROR = -503
    LEADER_WARMING_UP = -504
    WRONG_GROUP = -540
    """A key was sent to a master whose shard group does not own it (decision 0080)."""
    GROUP_MISMATCH = -541
    """A client, store or master disagrees with the cluster on the number of shard groups (decision 0080)."""

    # -600 .. -699: limits
    BATCH_TOO_LARGE = -600
    TOO_MANY_CONNECTIONS = -601
    TOO_MANY_BYTES_IN_FLIGHT = -602

    # -700 .. -799: operations (drain, scale)
    JOB_NOT_FOUND = -700
    DRAIN_FAILED = -701

    @property
    def message(self) -> str:
        """What the code means, in words (for logs, CLIs and ``str()``)."""
        return _MESSAGES.get(self, "")

    def __str__(self) -> str:
        # An IntEnum prints as a bare number otherwise ("-4"): say which code it is and what it means.
        return f"{self.name} ({int(self)}): {self.message}" if self.message else f"{self.name} ({int(self)})"

    def __format__(self, spec: str) -> str:
        # Numeric formats (f"{code:d}", f"{code:5}") stay numbers; a plain f"{code}" reads like str().
        return str(self) if not spec else format(int(self), spec)


_MESSAGES: dict[ErrorCode, str] = {
    ErrorCode.OK: "success",
    ErrorCode.INTERNAL: "internal error (a bug or an unexpected state)",
    ErrorCode.INVALID_ARGUMENT: "invalid argument",
    ErrorCode.TIMEOUT: "the call's deadline passed before it completed",
    ErrorCode.UNAVAILABLE: "the master or store cannot be reached (is the cluster up? check --master / KVPOOL_MASTER)",
    ErrorCode.CANCELLED: "the call was cancelled",
    ErrorCode.NOT_SUPPORTED: "not supported by this peer or build",
    ErrorCode.SHUTTING_DOWN: "the peer is shutting down",
    ErrorCode.OBJECT_NOT_FOUND: "no object under this key",
    ErrorCode.OBJECT_ALREADY_EXISTS: "an object under this key already exists (values are immutable)",
    ErrorCode.OBJECT_NOT_READY: "the object is still being written",
    ErrorCode.OBJECT_HAS_LEASE: "a read lease protects the object (remove with force, or retry after the lease)",
    ErrorCode.LEASE_EXPIRED: "the read completed after its lease ended; its bytes were discarded",
    ErrorCode.OBJECT_PINNED: "the object is pinned",
    ErrorCode.KEY_TOO_LONG: "the key is longer than the master's max_key_bytes",
    ErrorCode.INVALID_KEY: "the key is empty or not valid UTF-8",
    ErrorCode.VALUE_TOO_LARGE: "the value is larger than the master's max_object_bytes",
    ErrorCode.BUFFER_TOO_SMALL: "the destination buffer is smaller than the object",
    ErrorCode.ILLEGAL_CLIENT: "only the client that started a put may end or revoke it",
    ErrorCode.NO_PUT_IN_PROGRESS: "no put of this key is in progress",
    ErrorCode.NO_SPACE: "no writable segment can hold the object (no stores, all full, or all draining)",
    ErrorCode.DEMOTION_BACKLOG: "DRAM is full while objects move to the SSD tier (the client retries in its deadline)",
    ErrorCode.SEGMENT_NOT_FOUND: "no such segment",
    ErrorCode.SEGMENT_ALREADY_EXISTS: "the segment is already mounted",
    ErrorCode.SEGMENT_NOT_WRITABLE: "the segment is draining or drained: readable, but takes no new objects",
    ErrorCode.NEED_REMOUNT: "the master does not know this store: it must mount again",
    ErrorCode.STORE_NOT_FOUND: "no such store",
    ErrorCode.TRANSFER_FAILED: "the data transfer failed",
    ErrorCode.CHECKSUM_MISMATCH: "the bytes read do not match the object's checksum (discarded)",
    ErrorCode.OUT_OF_BOUNDS: "the request names a range outside the segment or its grant",
    ErrorCode.BAD_FRAME: "a malformed frame (the connection was closed)",
    ErrorCode.AUTH_FAILED: "the token or grant does not verify (check --token-file / KVPOOL_TOKEN_FILE)",
    ErrorCode.AUTH_VERSION_MISMATCH: "the peer runs a kvpool whose token handshake differs (upgrade the older side)",
    ErrorCode.GRANT_EXPIRED: "the data-plane grant has expired",
    ErrorCode.CONNECTION_FAILED: "the connection to a store failed",
    ErrorCode.UNKNOWN_OP: "the peer does not know this operation (a version mismatch?)",
    ErrorCode.RPC_FAILED: "the RPC failed",
    ErrorCode.NOT_LEADER: "this master is a standby; the leader serves",
    ErrorCode.STALE_VIEW: "the answer came from a deposed leader (refused)",
    ErrorCode.ETCD_ERROR: "etcd failed or cannot be reached",
    ErrorCode.LEADER_WARMING_UP: "the new leader is still rebuilding its state from the stores",
    ErrorCode.WRONG_GROUP: "the key belongs to another shard group's master",
    ErrorCode.GROUP_MISMATCH: "the caller and the master disagree on the cluster's shard groups",
    ErrorCode.BATCH_TOO_LARGE: "more keys in one call than the master's max_batch",
    ErrorCode.TOO_MANY_CONNECTIONS: "this client has too many connections to the store",
    ErrorCode.TOO_MANY_BYTES_IN_FLIGHT: "this client has too many bytes in flight at the store",
    ErrorCode.JOB_NOT_FOUND: "no such job",
    ErrorCode.DRAIN_FAILED: "the drain failed",
}


def strerror(code: int) -> str:
    """A human name for any code, including unknown ones (they come from newer peers)."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"UNKNOWN_ERROR({code})"


def as_code(value: int) -> ErrorCode:
    """Map an int from the wire to an ErrorCode; unknown values become INTERNAL."""
    # A dict lookup, not ErrorCode(value): the Enum call is slower, and paid per key of every batch (0050).
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
        super().__init__(f"{code.name}: {message}" if message else f"{code.name}: {code.message}")
