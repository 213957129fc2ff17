"""A store's segment: one shared-memory file, mapped read-write, that the data plane reads and writes.

The segment is a file (not anonymous memory) so that same-node clients can map it and copy without any RPC
(docs/architecture.md). It lives in /dev/shm (tmpfs) or in a hugetlbfs mount when hugepages are asked for. The file is
created with mode 0600 and O_EXCL, so only the pool's user can open it and nobody can plant a file (or a
symlink) under our name in the world-writable /dev/shm beforehand.

Hugepages never fall back silently: an operator who asked for them sized the machine for them, and a
silent fallback to 4 KiB pages would only show up later as a throughput or TLB-miss mystery.
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger

logger = get_logger(__name__)

PAGE_SIZE = mmap.PAGESIZE
HUGEPAGE_BYTES = {"2M": 2 << 20, "1G": 1 << 30}
_HUGETLBFS = "hugetlbfs"
# madvise(MADV_POPULATE_WRITE) (Linux 5.14): fault in every page writable in one call. Python 3.11's mmap
# module lacks the constant, but passes any advice value through to madvise(2).
_MADV_POPULATE_WRITE = 23


def new_segment_id() -> int:
    """A random 63-bit id: positive in every signed 64-bit field it crosses (protobuf, SQL, JSON)."""
    return secrets.randbits(63) or 1


class ShmSegment:
    """One mapped shared-memory segment. ``view`` is a writable memoryview over all ``size`` bytes."""

    def __init__(
        self,
        path: str,
        size: int,
        mapping: mmap.mmap,
        segment_id: int,
        owner: bool,
        hugepages: str = "",
        fd: int = -1,
    ) -> None:
        self.path = path
        self.size = size
        self.id = segment_id
        self.hugepages = hugepages
        self._mmap = mapping
        self._owner = owner
        self._closed = False
        self.view = memoryview(mapping)
        self.fd = fd
        """The open file (the creator's), for ``os.sendfile`` of READs; -1 when there is none."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        directory: str,
        name: str,
        size: int,
        hugepages: str = "",
        segment_id: int | None = None,
        replace: bool = False,
    ) -> ShmSegment:
        """Create ``directory/name`` (mode 0600), size it and map it shared.

        ``hugepages`` is "", "2M" or "1G"; for the latter two ``directory`` must be a hugetlbfs mount with
        that page size, ``size`` a multiple of it, and enough free hugepages, else INVALID_ARGUMENT.
        ``replace`` removes a leftover file of the same name first (a restarted store reusing its name);
        without it an existing file is SEGMENT_ALREADY_EXISTS.
        """
        _check_name(name)
        if size <= 0:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"segment size must be positive, got {size}")
        if hugepages:
            _check_hugepages(directory, size, hugepages)
        path = os.path.join(directory, name)
        if replace:
            _unlink_quietly(path)
        fd = _create_file(path)
        try:
            os.fchmod(fd, 0o600)  # the umask can only narrow 0600; make it exact anyway
            os.ftruncate(fd, size)
            mapping = _map(fd, size, path, hugepages)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        seg_id = new_segment_id() if segment_id is None else segment_id
        logger.info(
            "created segment %x: %s, %d bytes%s",
            seg_id,
            path,
            size,
            f", {hugepages} hugepages" if hugepages else "",
        )
        # The fd stays open: the data plane sends READs from the file's pages with sendfile (no copy).
        return cls(path, size, mapping, seg_id, owner=True, hugepages=hugepages, fd=fd)

    @classmethod
    def attach(cls, path: str, size: int, segment_id: int = 0) -> ShmSegment:
        """Map an existing segment file read-write (a same-node client). The file must hold ``size`` bytes."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise KvPoolError(ErrorCode.SEGMENT_NOT_FOUND, f"cannot open segment {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"{path} is not a regular file")
            if size <= 0 or st.st_size < size:
                raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"segment {path} holds {st.st_size} bytes, {size} asked")
            mapping = _map(fd, size, path, "")
        finally:
            os.close(fd)
        return cls(path, size, mapping, segment_id, owner=False)

    # ------------------------------------------------------------------ use
    def prefault(self) -> None:
        """Fault in every page now (writable), so the first transfers do not run at page-fault speed.

        Call before serving: the fallback path rewrites one byte per page with its own value.
        """
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
            return
        except (OSError, ValueError):
            pass  # older kernel: touch the pages ourselves
        step = HUGEPAGE_BYTES.get(self.hugepages, PAGE_SIZE)
        view = self.view
        for pos in range(0, self.size, step):
            view[pos] = view[pos]

    def close(self, unlink: bool = True) -> None:
        """Unmap (and, for the creator, remove the file unless ``unlink`` is False). Safe to call twice.

        Every memoryview taken from ``view`` must be released first; if one is still alive the mapping is
        left to the garbage collector (the file is still removed) and a warning is logged.
        """
        if self._closed:
            return
        self._closed = True
        if unlink and self._owner:
            _unlink_quietly(self.path)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:
            logger.warning("segment %s closed while views of it are alive; unmapped when they go", self.path)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShmSegment(id={self.id:#x}, path={self.path!r}, size={self.size})"


# ---------------------------------------------------------------------- helpers
def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"bad segment file name {name!r}")


def _create_file(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except FileExistsError as exc:
        raise KvPoolError(
            ErrorCode.SEGMENT_ALREADY_EXISTS,
            f"{path} exists (another store, or a leftover: remove it or pass replace)",
        ) from exc
    except OSError as exc:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"cannot create segment file {path}: {exc}") from exc


def _map(fd: int, size: int, path: str, hugepages: str) -> mmap.mmap:
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        what = f"{hugepages} hugepages" if hugepages else "shared memory"
        code = ErrorCode.INVALID_ARGUMENT
        raise KvPoolError(code, f"cannot map {size} bytes of {what} from {path}: {exc}") from exc


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _mount_of(directory: str) -> tuple[str, str, str]:
    """(mount point, fs type, super options) of the mount holding ``directory``, from /proc/self/mountinfo."""
    real = os.path.realpath(directory)
    best = ("", "", "")
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            mount_point = fields[4].replace("\\040", " ")
            inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best[0]):
                best = (mount_point, fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else "")
    return best


def _hugetlbfs_pagesize(options: str) -> int:
    for opt in options.split(","):
        if opt.startswith("pagesize="):
            value = opt.split("=", 1)[1].upper()
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            return int(value[:-1]) * units[value[-1]] if value[-1] in units else int(value)
    return 2 << 20  # hugetlbfs default: the system default hugepage size (2 MiB on x86-64)


def _free_hugepages(page_bytes: int) -> int:
    path = f"/sys/kernel/mm/hugepages/hugepages-{page_bytes // 1024}kB/free_hugepages"
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read())
    except OSError:
        return 0


def _check_hugepages(directory: str, size: int, hugepages: str) -> None:
    """Refuse, with the reason, any hugepage request this machine cannot honour."""
    page = HUGEPAGE_BYTES.get(hugepages)
    if page is None:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"hugepages must be '', '2M' or '1G', got {hugepages!r}")
    mount_point, fstype, options = _mount_of(directory)
    if fstype != _HUGETLBFS:
        raise KvPoolError(
            ErrorCode.INVALID_ARGUMENT,
            f"--hugepages {hugepages} needs a hugetlbfs mount, but {directory} is on "
            f"{fstype or 'an unknown fs'} "
            f"(mount -t hugetlbfs -o pagesize={hugepages} none DIR)",
        )
    if _hugetlbfs_pagesize(options) != page:
        raise KvPoolError(
            ErrorCode.INVALID_ARGUMENT,
            f"hugetlbfs at {mount_point} has options {options!r}, not pagesize={hugepages}",
        )
    if size % page:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"segment size {size} is not a multiple of {hugepages}")
    free = _free_hugepages(page)
    if free * page < size:
        raise KvPoolError(
            ErrorCode.INVALID_ARGUMENT,
            f"{size // page} free {hugepages} hugepages needed, {free} available "
            f"(raise /sys/kernel/mm/hugepages/hugepages-{page // 1024}kB/nr_hugepages)",
        )
