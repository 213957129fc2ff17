"""The store's SSD tier: one data file addressed by the master's SSD offsets, and an append-only journal
that describes it, replayed when the store restarts.

The master allocates SSD ranges like DRAM ranges (an offset allocator over ``ssd_size`` bytes, which is how it
accounts for the tier's capacity). The store keeps the values at exactly those offsets in one sparse file,
``<ssd_dir>/data.kvs``, so a demotion is one ``pwrite`` and a read one ``sendfile``. Why not one file per
object: creating and deleting small files costs far more file-system metadata work than a ``pwrite``, and it
would bound the demotion rate far below the put rate (figures: docs/ssd-tier.md, "On the store").

Demotions come in batches (:meth:`SsdTier.write_many`): verified and written by several threads, adjacent
values in one ``pwritev``, page-aligned ones with ``O_DIRECT`` from the shared-memory segment to the disk,
and one journal append per batch (docs/ssd-tier.md, docs/decisions/0035-batched-direct-demotion-and-backpressure.md).

What is where is kept in ``<ssd_dir>/journal.kvs``, append-only, so that a restarted store rebuilds its SSD
inventory (Mooncake loses it on a restart: issue #2254)::

    file header  8s   b"KVPJRNL1"
    record       4s   b"KVPR"
                 u8   kind: 1 = PUT (the value is at [offset, offset + length)), 2 = DELETE (offset)
                 u8   reserved
                 u16  key_len
                 u64  offset
                 u64  length
                 u64  checksum (xxh3-64 of the value: the object's checksum)
                 key  key_len bytes
                 u64  digest: xxh3-64 of the record and the key (a torn or damaged record is detected)

A PUT is appended after its value is written, a DELETE when the master frees the range. At start the
journal is replayed up to the first damaged record (the rest is ignored, with a log line); every surviving
entry's value is read back and checked against its checksum, and an entry whose value is missing
(truncated data file) or wrong is dropped with a log line. The journal is then rewritten with only the live
entries (also done at run time when it has grown to several times that size).

No fsync: a store crash keeps the page cache; after a power loss, what did not reach the disk fails those
checks and is dropped (a cache may lose objects; it must never serve wrong bytes). Reads check the grant's
key and length against the journal's entry for that offset before sending a byte, and readers verify the
checksum.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import xxhash

from kvpool.common.checksum import checksum
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger

__all__ = [
    "FILE_MAGIC",
    "RECORD",
    "DemoteItem",
    "SsdEntry",
    "SsdScan",
    "SsdTier",
    "encode_record",
    "parse_records",
]

log = get_logger(__name__)

T = TypeVar("T")
R = TypeVar("R")

DATA_FILE = "data.kvs"
JOURNAL_FILE = "journal.kvs"
FILE_MAGIC = b"KVPJRNL1"
RECORD_MAGIC = b"KVPR"
RECORD = struct.Struct("<4sBBHQQQ")
_DIGEST = struct.Struct("<Q")
PUT, DELETE = 1, 2
_MAX_KEY = 0xFFFF
_VERIFY_CHUNK = 4 << 20
COMPACT_MIN_BYTES = 16 << 20
"""The journal is rewritten at run time once it is this big and 4x the size of its live records."""
DIRECT_ALIGN = 4096
"""O_DIRECT needs file offsets, lengths and buffer addresses on this boundary (a page covers every
logical block size in use)."""
RUN_MAX_BYTES = 8 << 20
"""A batch's adjacent objects are written with one pwritev of at most this many bytes."""
RUN_MAX_PARTS = 512
"""... and at most this many buffers (below IOV_MAX)."""
PARALLEL_MIN_BYTES = 64 << 10
"""Values (and runs) at least this big are hashed and written on the I/O threads; smaller ones inline."""
WRITERS = 4
"""Threads that write a batch's runs (and verify its checksums) in parallel; the disk takes several
requests at once, and each pwritev releases the GIL."""


@dataclass(frozen=True, slots=True)
class SsdEntry:
    """One object on the SSD tier (what the store reports to the master, with ``tier=1``)."""

    key: bytes
    offset: int
    length: int
    checksum: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class SsdScan:
    """What a restart found: entries adopted, entries dropped (offset, why), where the journal was damaged."""

    adopted: int
    dropped: list[tuple[int, str]]
    damaged_at: int | None = None
    """Byte offset of the first damaged journal record (None: the journal was intact)."""


def encode_record(kind: int, key: bytes, offset: int, length: int, value_checksum: int) -> bytes:
    if len(key) > _MAX_KEY:
        raise ValueError(f"key of {len(key)} bytes")
    body = RECORD.pack(RECORD_MAGIC, kind, 0, len(key), offset, length, value_checksum) + key
    return body + _DIGEST.pack(xxhash.xxh3_64_intdigest(body))


def parse_records(raw: bytes) -> tuple[list[tuple[int, SsdEntry]], int | None, str]:
    """Records of a journal: ([(kind, entry)], offset of the first damaged record or None, why)."""
    if raw[: len(FILE_MAGIC)] != FILE_MAGIC:
        return [], 0, "not a journal (bad file header)"
    out: list[tuple[int, SsdEntry]] = []
    pos = len(FILE_MAGIC)
    while pos < len(raw):
        if len(raw) - pos < RECORD.size:
            return out, pos, "truncated record"
        magic, kind, _res, key_len, offset, length, value_checksum = RECORD.unpack_from(raw, pos)
        end = pos + RECORD.size + key_len
        if magic != RECORD_MAGIC or kind not in (PUT, DELETE):
            return out, pos, "bad record"
        if len(raw) < end + _DIGEST.size:
            return out, pos, "truncated record"
        if _DIGEST.unpack_from(raw, end)[0] != xxhash.xxh3_64_intdigest(raw[pos:end]):
            return out, pos, "record digest mismatch"
        out.append((kind, SsdEntry(raw[pos + RECORD.size : end], offset, length, value_checksum)))
        pos = end + _DIGEST.size
    return out, None, ""


@dataclass(frozen=True, slots=True)
class DemoteItem:
    """One object of a batched write: its SSD offset, key, value (a view of the DRAM segment) and checksum;
    of a batched read (:meth:`SsdTier.read_many`), ``value`` is the DRAM range the object lands in."""

    offset: int
    key: bytes
    value: memoryview
    checksum: int


class SsdTier:
    """The SSD directory of one store: write, read, delete and re-adopt objects. Thread-safe.

    Writes of a batch (:meth:`write_many`) are verified and written by ``WRITERS`` threads, adjacent objects
    coalesced into one ``pwritev``; where offsets, lengths and buffers are page-aligned (the master's
    allocators align to pages, and the DRAM segment is page-mapped) they go through a second descriptor
    opened with ``O_DIRECT``: straight from the shared-memory segment to the disk, without filling the page
    cache with values that are, by definition, cold. A file system without O_DIRECT (tmpfs) gets buffered
    writes."""

    def __init__(self, directory: str | Path, capacity: int) -> None:
        if capacity <= 0:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"--ssd-size must be positive, got {capacity}")
        self.directory = Path(directory)
        self.capacity = capacity
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self.directory)
        self._lock = threading.Lock()
        self._entries: dict[int, SsdEntry] = {}
        self._starts: list[int] = []
        self._used = 0
        self._data_fd = os.open(self.directory / DATA_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        self._direct_fd = _open_direct(self.directory / DATA_FILE)
        self._pool: ThreadPoolExecutor | None = None
        self._io_lock = threading.Lock()
        self.written_bytes = 0
        """Value bytes written to the data file since the start (a counter for the SSD write rate)."""
        self.read_bytes = 0
        """Value bytes read from the data file since the start (promotions and data-plane reads)."""
        self._journal_fd = -1
        self._journal_bytes = 0
        self._record_bytes = 0
        """Bytes the live entries' PUT records take: what a compacted journal would be."""

    @property
    def direct(self) -> bool:
        """Whether aligned writes and reads bypass the page cache (O_DIRECT)."""
        return self._direct_fd >= 0

    def note_read(self, nbytes: int) -> None:
        with self._io_lock:
            self.read_bytes += nbytes

    def _note_written(self, nbytes: int) -> None:
        with self._io_lock:
            self.written_bytes += nbytes

    @property
    def data_fd(self) -> int:
        """The data file (pread/sendfile at an entry's offset; never closed while the tier is open)."""
        return self._data_fd

    # ------------------------------------------------------------------ restart

    def scan(self) -> SsdScan:
        """Rebuild the index from the journal and the data file; drop (and log) what fails its checks; then
        rewrite the journal with the live entries and size the data file to the tier."""
        path = self.directory / JOURNAL_FILE
        raw = path.read_bytes() if path.exists() else FILE_MAGIC
        records, damaged_at, why = parse_records(raw)
        if damaged_at is not None:
            log.warning("SSD tier: journal %s damaged at byte %d (%s): ignoring the rest", path, damaged_at, why)
        dropped: list[tuple[int, str]] = []
        size = os.fstat(self._data_fd).st_size
        with self._lock:
            self._entries.clear()
            self._starts.clear()
            self._used = self._record_bytes = 0
            for kind, entry in records:  # replay: a PUT replaces what it overlaps, a DELETE its offset
                if kind == PUT:
                    for old in self._overlapping(entry.offset, entry.length):
                        self._remove(old)
                    self._insert(entry)
                elif (old_entry := self._entries.get(entry.offset)) is not None:
                    self._remove(old_entry)
            for entry in [self._entries[s] for s in self._starts]:
                problem = self._check(entry, size)
                if problem:
                    log.warning("SSD tier: dropping %r at offset %d: %s", entry.key, entry.offset, problem)
                    dropped.append((entry.offset, problem))
                    self._remove(entry)
            kept = len(self._entries)
            self._rewrite_journal()
        os.ftruncate(self._data_fd, self.capacity)  # sparse; also cuts what a smaller tier no longer holds
        if kept or dropped:
            log.info(
                "SSD tier %s: re-adopted %d objects (%d bytes), dropped %d",
                self.directory,
                kept,
                self._used,
                len(dropped),
            )
        return SsdScan(kept, dropped, damaged_at)

    def _check(self, entry: SsdEntry, data_size: int) -> str:
        if entry.length <= 0 or entry.end > self.capacity:
            return f"range [{entry.offset}, {entry.end}) outside the tier of {self.capacity} bytes"
        if entry.end > data_size:
            return f"data file truncated ({data_size} bytes)"
        hasher = xxhash.xxh3_64()
        pos = entry.offset
        while pos < entry.end:
            chunk = os.pread(self._data_fd, min(_VERIFY_CHUNK, entry.end - pos), pos)
            if not chunk:
                return "data file truncated"
            hasher.update(chunk)
            pos += len(chunk)
        return "" if hasher.intdigest() == entry.checksum else "value checksum mismatch"

    # ------------------------------------------------------------------ writes (the tier worker)

    def write(self, offset: int, key: bytes, value: memoryview, value_checksum: int) -> ErrorCode:
        """Store ``value`` as the object at ``offset``; its checksum is verified first."""
        return self.write_many([DemoteItem(offset, key, value, value_checksum)])[0]

    def write_many(self, items: Sequence[DemoteItem]) -> list[ErrorCode]:
        """Store a batch of objects (one code per item, in order): checksums verified and values written in
        parallel, adjacent values in one ``pwritev``, then one journal append for the whole batch."""
        codes: list[ErrorCode] = [self._refuse(item) for item in items]
        candidates = [i for i, code in enumerate(codes) if code == ErrorCode.OK]
        sums = self._map(lambda i: checksum(items[i].value), candidates, lambda i: len(items[i].value))
        for i, value_checksum in zip(candidates, sums, strict=True):
            if value_checksum != items[i].checksum:
                codes[i] = ErrorCode.CHECKSUM_MISMATCH
        valid = sorted((i for i in candidates if codes[i] == ErrorCode.OK), key=lambda i: items[i].offset)
        runs = _runs([items[i] for i in valid], valid)
        with self._lock:
            # Forget what the ranges held before their bytes change (a reader then gets a miss, not a mix).
            for i in valid:
                for old in self._overlapping(items[i].offset, len(items[i].value)):
                    self._remove(old)
            for run, failure in zip(runs, self._map(self._write_run, runs, lambda r: r.length), strict=True):
                if failure is not None:
                    for i in run.indexes:
                        codes[i] = failure
            done = [i for i in valid if codes[i] == ErrorCode.OK]
            records = b"".join(
                encode_record(PUT, items[i].key, items[i].offset, len(items[i].value), items[i].checksum) for i in done
            )
            try:
                if records:
                    self._append(records)
            except OSError as exc:
                log.warning("SSD tier: journaling %d writes failed: %s", len(done), exc)
                for i in done:
                    codes[i] = ErrorCode.NO_SPACE if exc.errno == errno.ENOSPC else ErrorCode.INTERNAL
                done = []
            for i in done:
                item = items[i]
                self._insert(SsdEntry(bytes(item.key), item.offset, len(item.value), item.checksum))
            self._maybe_compact()
        self._note_written(sum(len(items[i].value) for i in done))
        return codes

    def _refuse(self, item: DemoteItem) -> ErrorCode:
        length = len(item.value)
        if item.offset < 0 or length <= 0 or item.offset + length > self.capacity or len(item.key) > _MAX_KEY:
            return ErrorCode.OUT_OF_BOUNDS
        return ErrorCode.OK

    def _map(self, work: Callable[[T], R], items: Sequence[T], size: Callable[[T], int]) -> list[R]:
        """``work`` over ``items`` in order: the large ones on the I/O threads, the small ones inline (a thread
        hand-off costs more than hashing or writing a few KiB, and xxhash keeps the GIL below 64 KiB)."""
        large = [i for i, item in enumerate(items) if size(item) >= PARALLEL_MIN_BYTES]
        if len(large) <= 1:
            return [work(item) for item in items]
        out: list[R | None] = [None] * len(items)
        futures = {i: self._writers().submit(work, items[i]) for i in large}
        for i, item in enumerate(items):
            if i not in futures:
                out[i] = work(item)
        for i, future in futures.items():
            out[i] = future.result()
        return cast(list[R], out)

    def in_parallel(self, work: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``work`` over ``items`` on the tier's I/O threads (disk reads and writes release the GIL), in order."""
        if len(items) <= 1:
            return [work(item) for item in items]
        return list(self._writers().map(work, items))

    def _writers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="kvpool-ssd-writer")
        return self._pool

    def _write_run(self, run: _Run) -> ErrorCode | None:
        """Write one run of adjacent values; None when it all reached the file, else the run's code."""
        fd = self._direct_fd if run.aligned and self._direct_fd >= 0 else self._data_fd
        try:
            _pwritev_all(fd, run.parts, run.offset, self._data_fd)
        except OSError as exc:
            log.warning("SSD tier: writing %d bytes at %d failed: %s", run.length, run.offset, exc)
            return ErrorCode.NO_SPACE if exc.errno == errno.ENOSPC else ErrorCode.INTERNAL
        return None

    def delete(self, offset: int) -> bool:
        """The master freed this range: forget its object."""
        with self._lock:
            entry = self._entries.get(offset)
            if entry is None:
                return False
            self._remove(entry)
            try:
                self._append(encode_record(DELETE, b"", offset, entry.length, 0))
            except OSError as exc:  # at worst the object comes back after a restart: harmless
                log.warning("SSD tier: journaling a delete failed: %s", exc)
            self._maybe_compact()
        return True

    # ------------------------------------------------------------------ reads

    def locate(self, offset: int, key: bytes, length: int) -> int | ErrorCode:
        """The data-file offset of the object at ``offset`` if it is ``key`` with ``length`` bytes."""
        entry = self._entries.get(offset)
        if entry is None or entry.key != key or entry.length != length:
            return ErrorCode.OBJECT_NOT_FOUND
        return offset

    def read_into(self, offset: int, key: bytes, dest: memoryview, value_checksum: int) -> ErrorCode:
        """Copy the object's value into ``dest`` (len = its length) and verify its checksum."""
        found = self.locate(offset, key, len(dest))
        if isinstance(found, ErrorCode):
            return found
        fd = self._direct_fd if self._direct_fd >= 0 and _aligned(found, dest) else self._data_fd
        try:
            done = 0
            while done < len(dest):
                try:
                    n = os.preadv(fd, [dest[done:]], found + done)
                except OSError as exc:
                    if fd == self._data_fd or exc.errno != errno.EINVAL:
                        raise
                    fd = self._data_fd  # a file system that took O_DIRECT at open but refuses this read
                    continue
                if n <= 0:
                    return ErrorCode.OBJECT_NOT_FOUND
                done += n
        except OSError:
            return ErrorCode.INTERNAL
        self.note_read(done)
        return ErrorCode.OK if checksum(dest) == value_checksum else ErrorCode.CHECKSUM_MISMATCH

    def read_many(self, items: Sequence[DemoteItem]) -> list[ErrorCode]:
        """Read a batch of objects into their buffers (``value``: where each lands; one code per item, in
        order): adjacent objects in one ``preadv`` (O_DIRECT where aligned), runs and checksums on the I/O
        threads. A run the disk reads short or refuses is read again object by object."""
        codes: list[ErrorCode] = []
        for item in items:
            found = self.locate(item.offset, item.key, len(item.value))
            codes.append(found if isinstance(found, ErrorCode) else ErrorCode.OK)
        valid = sorted((i for i, code in enumerate(codes) if code == ErrorCode.OK), key=lambda i: items[i].offset)
        runs = _runs([items[i] for i in valid], valid)
        verify: list[int] = []
        for run, whole in zip(runs, self._map(self._read_run, runs, lambda r: r.length), strict=True):
            if whole:
                verify += run.indexes
                continue
            for i in run.indexes:
                item = items[i]
                codes[i] = self.read_into(item.offset, item.key, item.value, item.checksum)
        sums = self._map(lambda i: checksum(items[i].value), verify, lambda i: len(items[i].value))
        for i, value_checksum in zip(verify, sums, strict=True):
            if value_checksum != items[i].checksum:
                codes[i] = ErrorCode.CHECKSUM_MISMATCH
        self.note_read(sum(len(items[i].value) for i in verify))
        return codes

    def _read_run(self, run: _Run) -> bool:
        """Read one run of adjacent objects with one preadv; False when it came back short or refused."""
        fd = self._direct_fd if run.aligned and self._direct_fd >= 0 else self._data_fd
        try:
            return os.preadv(fd, run.parts, run.offset) == run.length
        except OSError:
            return False

    # ------------------------------------------------------------------ views

    def entries(self) -> list[SsdEntry]:
        with self._lock:
            return [self._entries[s] for s in self._starts]

    @property
    def used(self) -> int:
        return self._used

    @property
    def journal_bytes(self) -> int:
        return self._journal_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            for fd in (self._journal_fd, self._direct_fd, self._data_fd, self._lock_fd):
                if fd >= 0:
                    os.close(fd)
            self._journal_fd = self._direct_fd = self._data_fd = self._lock_fd = -1

    # ------------------------------------------------------------------ journal (under _lock)

    def _append(self, record: bytes) -> None:
        if self._journal_fd < 0:
            self._rewrite_journal()
        os.write(self._journal_fd, record)
        self._journal_bytes += len(record)

    def _maybe_compact(self) -> None:
        if self._journal_bytes > max(COMPACT_MIN_BYTES, 4 * self._record_bytes):
            self._rewrite_journal()

    def _rewrite_journal(self) -> None:
        """Replace the journal with one PUT record per live entry (written aside, then renamed)."""
        path = self.directory / JOURNAL_FILE
        temp = path.with_name(JOURNAL_FILE + ".new")
        body = b"".join(
            encode_record(PUT, e.key, e.offset, e.length, e.checksum) for e in (self._entries[s] for s in self._starts)
        )
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _pwrite_all(fd, memoryview(FILE_MAGIC + body), 0)
        except BaseException:
            os.close(fd)
            raise
        os.replace(temp, path)
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
        os.lseek(fd, 0, os.SEEK_END)
        self._journal_fd = fd
        self._journal_bytes = len(FILE_MAGIC) + len(body)

    # ------------------------------------------------------------------ index (under _lock)

    def _overlapping(self, offset: int, length: int) -> list[SsdEntry]:
        i = bisect.bisect_left(self._starts, offset + length)
        found: list[SsdEntry] = []
        while i > 0:
            entry = self._entries[self._starts[i - 1]]
            if entry.end <= offset:
                break
            found.append(entry)
            i -= 1
        return found

    def _insert(self, entry: SsdEntry) -> None:
        bisect.insort(self._starts, entry.offset)
        self._entries[entry.offset] = entry
        self._used += entry.length
        self._record_bytes += RECORD.size + len(entry.key) + _DIGEST.size

    def _remove(self, entry: SsdEntry) -> None:
        del self._entries[entry.offset]
        del self._starts[bisect.bisect_left(self._starts, entry.offset)]
        self._used -= entry.length
        self._record_bytes -= RECORD.size + len(entry.key) + _DIGEST.size


@dataclass(slots=True)
class _Run:
    """Adjacent values of a batch, written with one pwritev."""

    offset: int
    parts: list[memoryview]
    indexes: list[int]
    length: int
    aligned: bool


def _runs(items: Sequence[DemoteItem], indexes: Sequence[int]) -> list[_Run]:
    """Group ``items`` (sorted by offset) into runs of adjacent values of one alignment class."""
    runs: list[_Run] = []
    for item, index in zip(items, indexes, strict=True):
        aligned = _aligned(item.offset, item.value)
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.offset + last.length == item.offset
            and last.aligned == aligned
            and last.length + len(item.value) <= RUN_MAX_BYTES
            and len(last.parts) < RUN_MAX_PARTS
        ):
            last.parts.append(item.value)
            last.indexes.append(index)
            last.length += len(item.value)
        else:
            runs.append(_Run(item.offset, [item.value], [index], len(item.value), aligned))
    return runs


def _aligned(offset: int, view: memoryview) -> bool:
    """Can this file offset and buffer go through O_DIRECT?"""
    if offset % DIRECT_ALIGN or len(view) % DIRECT_ALIGN or view.readonly:
        return False
    anchor = ctypes.c_char.from_buffer(view)
    address = ctypes.addressof(anchor)
    del anchor
    return address % DIRECT_ALIGN == 0


def _open_direct(path: Path) -> int:
    """A second descriptor of the data file with O_DIRECT, or -1 where the file system has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return os.open(path, os.O_RDWR | flag)
    except OSError:
        return -1


def _pwritev_all(fd: int, parts: list[memoryview], offset: int, fallback_fd: int) -> None:
    """Write every byte of ``parts`` at ``offset``; what a short or refused direct write leaves goes through
    ``fallback_fd`` (buffered)."""
    total = sum(len(p) for p in parts)
    try:
        written = os.pwritev(fd, parts, offset)
    except OSError as exc:
        if fd == fallback_fd or exc.errno != errno.EINVAL:
            raise
        written = 0
    if written >= total:
        return
    skip = written
    for part in parts:
        if skip >= len(part):
            skip -= len(part)
            offset += len(part)
            continue
        _pwrite_all(fallback_fd, part[skip:], offset + skip)
        offset += len(part)
        skip = 0


def _lock_directory(directory: Path) -> int:
    """Hold an exclusive lock on the directory for the life of the process: two stores sharing one SSD
    directory would overwrite each other's objects. The kernel drops the lock when the process dies."""
    fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise KvPoolError(
            ErrorCode.INVALID_ARGUMENT, f"SSD directory {directory} is used by another store ({exc})"
        ) from exc
    return fd


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    view = data.cast("B") if data.format != "B" else data
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
