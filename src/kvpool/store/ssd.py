"""The store's SSD tier: one self-describing file per object, re-adopted when the store restarts.

The master allocates SSD ranges like DRAM ranges (an offset allocator over ``ssd_size`` bytes, which is how it
accounts for the tier's capacity); the store keeps each object in its own file named after that offset,
``<ssd_dir>/<offset:016x>.kvs``. One file per object rather than one big file because every file then
describes itself, so a restarted store rebuilds its SSD inventory by reading the directory (Mooncake loses
its SSD inventory on a restart: issue #2254), and a torn or corrupt file costs that object only.

File layout (little-endian)::

    magic    8s   b"KVPSSD1\\0"
    version  u16  1
    key_len  u16
    reserved u32
    offset   u64  the master's SSD offset (equals the file name)
    length   u64  value bytes
    checksum u64  xxh3-64 of the value (the object's checksum)
    key      key_len bytes
    digest   u64  xxh3-64 of everything above (catches a torn or damaged header)
    value    length bytes

Writes go to ``<name>.tmp`` and are renamed over the final name (atomic: a reader or a restart sees the
old file or the new one, never a mix). No fsync by default: a store crash keeps the page cache, and after a
power loss a torn file fails its checks at the next start and is dropped (a cache may lose objects, it must
never serve wrong bytes). At start every file is checked (header, size, value checksum); a bad one is
logged and deleted.

Reads open the file and check its header against the grant's key and length before sending a byte, so a
file replaced since the master's grant can never be served under the wrong key.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvpool.common.checksum import checksum
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger

__all__ = ["HEADER", "MAGIC", "SsdEntry", "SsdScan", "SsdTier", "encode_header", "parse_header"]

log = get_logger(__name__)

MAGIC = b"KVPSSD1\0"
VERSION = 1
HEADER = struct.Struct("<8sHHIQQQ")
_DIGEST = struct.Struct("<Q")
_NAME = re.compile(r"^([0-9a-f]{16})\.kvs$")
_MAX_KEY = 0xFFFF
_READ_CHUNK = 1 << 20


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
    """What a restart found: entries adopted, files dropped (with why), temporary files removed."""

    adopted: int
    dropped: list[tuple[str, str]]
    temporaries: int


def encode_header(key: bytes, offset: int, length: int, value_checksum: int) -> bytes:
    """Header + key + digest: everything before the value."""
    if len(key) > _MAX_KEY:
        raise ValueError(f"key of {len(key)} bytes")
    head = HEADER.pack(MAGIC, VERSION, len(key), 0, offset, length, value_checksum) + key
    return head + _DIGEST.pack(xxhash.xxh3_64_intdigest(head))


def parse_header(raw: bytes) -> tuple[SsdEntry, int] | str:
    """(entry, offset of the value in the file) from a file's first bytes, or why they are not a header."""
    if len(raw) < HEADER.size:
        return "truncated header"
    magic, version, key_len, _reserved, offset, length, value_checksum = HEADER.unpack_from(raw)
    if magic != MAGIC:
        return "bad magic"
    if version != VERSION:
        return f"unknown version {version}"
    end = HEADER.size + key_len
    if len(raw) < end + _DIGEST.size:
        return "truncated header"
    (digest,) = _DIGEST.unpack_from(raw, end)
    if digest != xxhash.xxh3_64_intdigest(raw[:end]):
        return "header digest mismatch"
    return SsdEntry(bytes(raw[HEADER.size:end]), offset, length, value_checksum), end + _DIGEST.size


def _file_name(offset: int) -> str:
    return f"{offset:016x}.kvs"


class SsdTier:
    """The SSD directory of one store: write, read, delete and re-adopt objects. Thread-safe."""

    def __init__(self, directory: str | Path, capacity: int) -> None:
        if capacity <= 0:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"--ssd-size must be positive, got {capacity}")
        self.directory = Path(directory)
        self.capacity = capacity
        self.size = capacity
        """Alias read by the data plane's bounds check (a segment's ``size``)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self.directory)
        self._lock = threading.Lock()
        self._entries: dict[int, SsdEntry] = {}
        self._starts: list[int] = []
        self._used = 0

    # ------------------------------------------------------------------ restart

    def scan(self) -> SsdScan:
        """Rebuild the index from the directory: check every file, drop the bad ones (logged)."""
        dropped: list[tuple[str, str]] = []
        temporaries = 0
        found: list[SsdEntry] = []
        for path in sorted(self.directory.iterdir()):
            if path.name.endswith(".tmp"):
                _unlink(path)  # a write the previous process did not finish
                temporaries += 1
                continue
            match = _NAME.match(path.name)
            if match is None:
                continue
            entry = self._check_file(path, int(match.group(1), 16))
            if isinstance(entry, str):
                log.warning("SSD tier: dropping %s: %s", path, entry)
                dropped.append((path.name, entry))
                _unlink(path)
            else:
                found.append(entry)
        with self._lock:
            self._entries.clear()
            self._starts.clear()
            self._used = 0
            for entry in sorted(found, key=lambda e: e.offset):
                if self._starts and self._entries[self._starts[-1]].end > entry.offset:
                    log.warning("SSD tier: dropping %s: overlaps the object before it",
                                _file_name(entry.offset))
                    dropped.append((_file_name(entry.offset), "overlap"))
                    _unlink(self.directory / _file_name(entry.offset))
                    continue
                self._insert(entry)
        if found or dropped:
            log.info("SSD tier %s: re-adopted %d objects (%d bytes), dropped %d files", self.directory,
                     len(self._entries), self._used, len(dropped))
        return SsdScan(len(self._entries), dropped, temporaries)

    def _check_file(self, path: Path, offset: int) -> SsdEntry | str:
        try:
            with open(path, "rb") as f:
                parsed = parse_header(f.read(HEADER.size + _MAX_KEY + _DIGEST.size))
                if isinstance(parsed, str):
                    return parsed
                entry, data_start = parsed
                if entry.offset != offset:
                    return f"header says offset {entry.offset}"
                if entry.end > self.capacity or entry.length <= 0:
                    return f"range [{entry.offset}, {entry.end}) outside the tier of {self.capacity} bytes"
                size = os.fstat(f.fileno()).st_size
                if size != data_start + entry.length:
                    return f"truncated: {size} bytes, expected {data_start + entry.length}"
                f.seek(data_start)
                hasher = xxhash.xxh3_64()
                while chunk := f.read(_READ_CHUNK):
                    hasher.update(chunk)
                if hasher.intdigest() != entry.checksum:
                    return "value checksum mismatch"
                return entry
        except OSError as exc:
            return f"unreadable: {exc}"

    # ------------------------------------------------------------------ writes (the tier worker)

    def write(self, offset: int, key: bytes, value: memoryview, value_checksum: int) -> ErrorCode:
        """Store ``value`` as the object at ``offset``; its checksum is verified first."""
        length = len(value)
        if offset < 0 or length <= 0 or offset + length > self.capacity:
            return ErrorCode.OUT_OF_BOUNDS
        if checksum(value) != value_checksum:
            return ErrorCode.CHECKSUM_MISMATCH
        final = self.directory / _file_name(offset)
        temp = final.with_name(final.name + ".tmp")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, [encode_header(key, offset, length, value_checksum), value])
            finally:
                os.close(fd)
            os.replace(temp, final)
        except OSError as exc:
            _unlink(temp)
            log.warning("SSD tier: writing %s failed: %s", final, exc)
            return ErrorCode.NO_SPACE if exc.errno == errno.ENOSPC else ErrorCode.INTERNAL
        with self._lock:
            for old in self._overlapping(offset, length):
                if old.offset != offset:  # the same offset was just replaced by the rename
                    _unlink(self.directory / _file_name(old.offset))
                self._remove(old)
            self._insert(SsdEntry(bytes(key), offset, length, value_checksum))
        return ErrorCode.OK

    def delete(self, offset: int) -> bool:
        """The master freed this range: delete its file (if any)."""
        with self._lock:
            entry = self._entries.get(offset)
            if entry is not None:
                self._remove(entry)
            _unlink(self.directory / _file_name(offset))
        return entry is not None

    # ------------------------------------------------------------------ reads

    def open_value(self, offset: int, key: bytes, length: int) -> tuple[int, int] | ErrorCode:
        """An open fd on the object's file and the file offset of its value, after checking that the file
        holds ``key`` with ``length`` bytes (the caller closes the fd)."""
        try:
            fd = os.open(self.directory / _file_name(offset), os.O_RDONLY)
        except FileNotFoundError:
            return ErrorCode.OBJECT_NOT_FOUND
        except OSError:
            return ErrorCode.INTERNAL
        try:
            parsed = parse_header(os.pread(fd, HEADER.size + len(key) + _DIGEST.size, 0))
        except OSError:
            parsed = "unreadable"
        if isinstance(parsed, str) or parsed[0].key != key or parsed[0].length != length:
            os.close(fd)
            return ErrorCode.OBJECT_NOT_FOUND
        return fd, parsed[1]

    def read_into(self, offset: int, key: bytes, dest: memoryview, value_checksum: int) -> ErrorCode:
        """Copy the object's value into ``dest`` (len = its length) and verify its checksum."""
        opened = self.open_value(offset, key, len(dest))
        if isinstance(opened, ErrorCode):
            return opened
        fd, start = opened
        try:
            done = 0
            while done < len(dest):
                n = os.preadv(fd, [dest[done:]], start + done)
                if n <= 0:
                    return ErrorCode.OBJECT_NOT_FOUND
                done += n
        except OSError:
            return ErrorCode.INTERNAL
        finally:
            os.close(fd)
        return ErrorCode.OK if checksum(dest) == value_checksum else ErrorCode.CHECKSUM_MISMATCH

    # ------------------------------------------------------------------ views

    def entries(self) -> list[SsdEntry]:
        with self._lock:
            return [self._entries[s] for s in self._starts]

    @property
    def used(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

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

    def _remove(self, entry: SsdEntry) -> None:
        del self._entries[entry.offset]
        del self._starts[bisect.bisect_left(self._starts, entry.offset)]
        self._used -= entry.length


def _lock_directory(directory: Path) -> int:
    """Hold an exclusive lock on the directory for the life of the process: two stores sharing one SSD
    directory would delete each other's objects. The kernel drops the lock when the process dies."""
    fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT,
                          f"SSD directory {directory} is used by another store ({exc})") from exc
    return fd


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(p) for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("SSD tier: cannot delete %s: %s", path, exc)
