"""The striping and dealing plan of the TCP transport: what a job and a batch are, pure.

Parts (:class:`_Part`) of requests are split near-equal and dealt to the least-loaded lanes; a
:class:`_Job` is what one lane runs, a :class:`_Batch` the caller's handle on all of them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvpool.common.checksum import LazyChecksum, checksum_value
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode
from kvpool.proto.frames import (
    DESC,
    FLAG_REVALIDATE,
    HEADER,
    MAGIC,
    VECTOR_COUNT,
    Op,
)
from kvpool.transfer.base import Replica, TransferBatch, TransferRequest
from kvpool.transfer.tcp_socket import _REQUEST

if TYPE_CHECKING:
    from kvpool.transfer.tcp_lane import _Lane

# Per-part cost in "bytes" when dealing parts to lanes: a request costs about as much as moving this much.
_PART_OVERHEAD = 32 * 1024


# ---------------------------------------------------------------------- jobs and batches
class _Broken(Exception):
    """The connection is unusable; every unanswered part of the job gets ``code``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _ReadCheck:
    """Verifies one READ request's bytes once its last part has landed (on the lane that received it)."""

    __slots__ = ("request", "left", "lock")

    def __init__(self, request: TransferRequest, parts: int) -> None:
        self.request = request
        self.left = parts
        self.lock = threading.Lock() if parts > 1 else None

    def landed(self) -> ErrorCode:
        if self.lock is not None:
            with self.lock:
                self.left -= 1
                if self.left:
                    return ErrorCode.OK
        return self.request.check_landed()


def _near_equal_parts(length: int, stripe: int) -> list[int]:
    """The part sizes of a value striped at ``stripe`` bytes: near-equal, so every lane finishes at about the
    same time (the last part is the shorter one)."""
    n_parts = max(1, -(-length // stripe))
    size = -(-length // n_parts)
    return [min(size, length - off) for off in range(0, length, size)] if length else [0]


def _least_loaded(sizes: list[int], loads: list[int]) -> list[int]:
    """Deal parts of ``sizes`` bytes, in order, each to the lane with the least load so far (a part costs
    its bytes plus a request); ``loads`` is updated. The lane index of each part."""
    lanes = len(loads)
    if sizes and lanes > 1 and min(sizes) == max(sizes) and min(loads) == max(loads):
        # Equal parts onto equally loaded lanes (a batch of pages on idle lanes): the least-loaded rule
        # deals them in turn, lowest index first; the same picks without a search per part.
        picks = [i % lanes for i in range(len(sizes))]
        for lane in range(min(lanes, len(sizes))):
            loads[lane] += (sizes[0] + _PART_OVERHEAD) * len(range(lane, len(sizes), lanes))
        return picks
    picks = []
    for n in sizes:
        i = loads.index(min(loads))
        loads[i] += n + _PART_OVERHEAD
        picks.append(i)
    return picks


def _makespan(sizes: list[int], lanes: int) -> int:
    """The busiest lane's cost once ``sizes`` are dealt to ``lanes`` idle lanes as ``_deal`` deals them."""
    loads = [0] * min(lanes, max(1, len(sizes)))
    _least_loaded(sizes, loads)
    return max(loads)


def _source_page(part: _Part) -> int:
    """Where in its 4 KiB page the first byte the store sends for this large READ part lies if the store
    sends it from the segment's pages (sendfile; its reply then says FLAG_FROM_PAGES): at the object's
    offset plus the part's. The compiled loop bounces such a part when its destination would make the
    kernel's copy slow (_lanes.c)."""
    assert part.replica is not None
    return (part.replica.offset + part.part_offset) % 4096


class _Part:
    """One request on the wire: a part of one object (or a control op, with no replica)."""

    __slots__ = ("index", "op", "view", "replica", "key", "checksum", "part_offset", "reply", "check", "flags")

    def __init__(
        self,
        index: int,
        op: Op,
        view: memoryview,
        replica: Replica | None = None,
        key: bytes = b"",
        checksum: int | LazyChecksum = 0,
        part_offset: int = 0,
        check: _ReadCheck | None = None,
        flags: int = 0,
    ) -> None:
        self.index = index  # the request's position in its batch
        self.op = op
        self.view = view  # source (WRITE) / destination (READ) bytes of this part
        self.replica = replica  # where, and the master's grant (mac, expiry) for the whole object
        self.key = key
        self.checksum = checksum  # a LazyChecksum is computed here, on the lane, just before the send
        self.part_offset = part_offset
        self.reply = b""  # STORE_INFO's payload
        self.check = check  # READ with verify: the bytes are checked once the request's last part lands
        self.flags = flags  # the frame header's flags: FLAG_REVALIDATE for a revalidated READ

    def desc_fields(self) -> tuple[int, int, int, int, int, int, int, int, bytes]:
        """The values of this part's DESC (frames.DESC's layout)."""
        r = self.replica
        assert r is not None
        return (
            r.segment_id,
            r.offset,
            r.length,
            r.expiry_ms,
            checksum_value(self.checksum),
            self.part_offset,
            len(self.view),
            len(self.key),
            r.mac,
        )

    def frame(self, req_id: int) -> bytes:
        if self.replica is None:  # control op: a bare header
            return HEADER.pack(MAGIC, self.op, 0, 0, req_id, 0)
        key = self.key
        length = DESC.size + len(key) + (len(self.view) if self.op == Op.WRITE else 0)
        return _REQUEST.pack(MAGIC, self.op, self.flags, 0, req_id, length, *self.desc_fields()) + key


def _vector_frame(req_id: int, parts: list[_Part]) -> bytes:
    """The header and descriptors of one READV/WRITEV frame for ``parts`` (a WRITEV's bytes follow).
    ``_Part.desc_fields`` inlined: this runs once per page of a batch."""
    pack = DESC.pack
    entries: list[bytes] = []
    for part in parts:
        r = part.replica
        assert r is not None
        checksum = part.checksum
        entries.append(
            pack(
                r.segment_id,
                r.offset,
                r.length,
                r.expiry_ms,
                checksum if isinstance(checksum, int) else checksum.value,
                part.part_offset,
                len(part.view),
                len(part.key),
                r.mac,
            )
        )
        entries.append(part.key)
    body = b"".join(entries)
    payload = sum([len(part.view) for part in parts]) if parts[0].op == Op.WRITE else 0
    return (
        HEADER.pack(
            MAGIC,
            Op.WRITEV if parts[0].op == Op.WRITE else Op.READV,
            # One flag for the whole frame: an entry that did not ask to be revalidated and whose grant
            # ended meanwhile may then be sent, but its reader still refuses it (the lease check).
            FLAG_REVALIDATE if any([part.flags for part in parts]) else 0,
            0,
            req_id,
            VECTOR_COUNT.size + len(body) + payload,
        )
        + VECTOR_COUNT.pack(len(parts))
        + body
    )


class _Solo:
    """The "batch" of a lone single-part request that its caller moves itself on an idle lane."""

    __slots__ = ("deadline", "cancelled")

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.cancelled = False  # nobody else can cancel it: the caller is the one waiting

    def job_done(self, job: _Job) -> None:
        """Nothing to merge: the caller reads ``job.codes`` itself."""


class _Job:
    """The parts of one batch that one lane moves, in order."""

    __slots__ = ("batch", "parts", "codes", "done", "cost")

    def __init__(self, batch: _Batch | _Solo, parts: list[_Part], cost: int = 0) -> None:
        self.batch = batch
        self.parts = parts
        self.codes: list[ErrorCode] = []
        self.done = 0  # parts [0, done) are answered
        self.cost = cost  # what it adds to its lane's load while queued or running

    def fail_rest(self, code: ErrorCode) -> None:
        self.codes.extend([code] * (len(self.parts) - len(self.codes)))
        self.done = len(self.parts)


class _Batch(TransferBatch):
    """Per-request codes of one submitted batch; a request is OK only if all its parts are.

    Completion is a plain lock held until the last job is done: cheaper than a threading.Event, whose cost
    is a noticeable share of a small get (docs/decisions/0050-measurements.md).
    """

    def __init__(self, n_requests: int, deadline: Deadline) -> None:
        self.codes: list[ErrorCode] = [ErrorCode.OK] * n_requests
        self.deadline = deadline
        self.cancelled = False
        self._lock = threading.Lock()
        self._latch = threading.Lock()
        self._latch.acquire()
        self._finished = False
        self._pending = 0
        self._jobs: list[tuple[_Lane, _Job]] = []

    def add_job(self, lane: _Lane, job: _Job) -> None:
        self._pending += 1
        self._jobs.append((lane, job))

    def seal(self) -> None:
        """All jobs are added; a batch with none is done already."""
        if self._pending == 0:
            self._finished = True
            self._latch.release()

    def job_done(self, job: _Job) -> None:
        with self._lock:
            if any(job.codes):  # ErrorCode.OK is 0: only failures need merging
                codes = self.codes
                for part, code in zip(job.parts, job.codes, strict=True):
                    if code and not codes[part.index]:
                        codes[part.index] = code
            self._pending -= 1
            if self._pending == 0:
                self._finished = True
                self._latch.release()

    def _wait_finished(self, timeout: float | None) -> bool:
        if self._finished:
            return True
        if not self._latch.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._latch.release()  # let any other waiter through too
        return True

    def wait(self, deadline: Deadline) -> list[ErrorCode]:
        if not self._finished and _not_sooner(deadline, self.deadline):
            for lane, job in self._jobs:  # help: run jobs no lane thread has picked up yet
                lane.run_inline(job)
        if not self._wait_finished(_min_remaining(deadline, self.deadline)):
            self.cancel()
            self._wait_finished(None)  # lanes give up promptly once their sockets are shut down
        return list(self.codes)

    def cancel(self) -> None:
        """Stop every job of this batch; unanswered parts become TIMEOUT."""
        self.cancelled = True
        for lane, job in self._jobs:
            lane.cancel(job)


def _not_sooner(a: Deadline, b: Deadline) -> bool:
    """Whether ``a`` ends no sooner than ``b`` (running b's work inline cannot overrun a)."""
    return a.at is None or (b.at is not None and b.at <= a.at)


def _min_remaining(a: Deadline, b: Deadline) -> float | None:
    ra, rb = a.remaining(), b.remaining()
    if ra is None:
        return rb
    return ra if rb is None else min(ra, rb)
