"""NUMA placement and hugepage checks for a store process (docs/architecture.md, Store: one store per NUMA node).

Why: a store serves its segment from the memory of one NUMA node, with its threads on that node's CPUs, so
that copies never cross the socket interconnect (and, with RDMA, the NIC local to that node is used). Two
things go wrong silently without care, and this module refuses both up front:

* binding to a node that does not exist: ``numa_alloc_onnode(.., 1)`` on a one-node machine warns and returns
  memory anyway, and ``numactl --membind=1`` fails only at run time - so the node is checked against
  ``/sys/devices/system/node/online`` and libnuma's ``numa_max_node()`` first, with the machine's nodes in the
  error;
* hugepages asked for but not reserved: a silent fallback to 4 KiB pages only shows later as a throughput or
  TLB-miss mystery (Mooncake makes them a hard requirement too), so :func:`require_hugepages` fails with the
  reason and the command that fixes it.

libnuma (Debian ``libnuma1``) is used through ctypes where installed; without it the same four calls go to
the raw syscalls (x86_64: mbind 237, set_mempolicy 238, move_pages 279; aarch64 has its own numbers), and on
an architecture we have no numbers for the call fails with a clear error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger

logger = get_logger(__name__)

NODE_SYSFS = "/sys/devices/system/node"
HUGEPAGES_SYSFS = "/sys/kernel/mm/hugepages"
MEMINFO = "/proc/meminfo"

MPOL_BIND = 2
MPOL_MF_STRICT = 1 << 0  # fail if a page of the range is not on the policy's nodes
MPOL_MF_MOVE = 1 << 1  # move the pages this process owns that are elsewhere
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_VERIFY_SAMPLES = 64

# Syscall numbers for the fallback without libnuma (asm/unistd.h of each architecture).
_SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {"mbind": 237, "set_mempolicy": 238, "move_pages": 279},
    "aarch64": {"mbind": 235, "set_mempolicy": 237, "move_pages": 239},
}

HUGEPAGE_KB = {"2M": 2048, "1G": 1024 * 1024}


class MappedMemory(Protocol):
    """What :func:`bind_memory` binds: a store segment (a memoryview over its mmap, and its size)."""

    @property
    def view(self) -> memoryview: ...

    @property
    def size(self) -> int: ...


# ---------------------------------------------------------------------- topology
def _parse_list(text: str) -> list[int]:
    """A kernel list ("0-3,8,10-11") as sorted ints."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def format_nodes(nodes: list[int]) -> str:
    """Nodes as runs, each written lo-hi ("0-0", "0-3", "0-1,4-5"), the way the error messages show them."""
    return ",".join(f"{lo}-{hi}" for lo, hi in _runs(nodes)) or "none"


def available_nodes() -> list[int]:
    """The online NUMA nodes. A kernel without NUMA support has exactly one: node 0."""
    try:
        with open(os.path.join(NODE_SYSFS, "online"), encoding="ascii") as f:
            nodes = _parse_list(f.read())
    except OSError:
        return [0]
    lib = _libnuma()
    if lib is not None and nodes:
        top = int(lib.numa_max_node())
        nodes = [n for n in nodes if n <= top]
    return nodes or [0]


def node_cpus(node: int) -> list[int]:
    """The CPUs of ``node`` (``/sys/devices/system/node/nodeN/cpulist``)."""
    check_node(node)
    try:
        with open(os.path.join(NODE_SYSFS, f"node{node}", "cpulist"), encoding="ascii") as f:
            return _parse_list(f.read())
    except FileNotFoundError:
        if node == 0 and not os.path.isdir(NODE_SYSFS):  # no NUMA in the kernel: every CPU is "node 0"
            return list(range(os.cpu_count() or 1))
        raise


def check_node(node: int) -> None:
    """INVALID_ARGUMENT naming the machine's nodes unless ``node`` exists."""
    nodes = available_nodes()
    if node not in nodes:
        raise KvPoolError(
            ErrorCode.INVALID_ARGUMENT,
            f"NUMA node {node} does not exist (this machine has nodes {format_nodes(nodes)})",
        )


# ---------------------------------------------------------------------- the calls: libnuma or syscalls
@functools.cache
def _libnuma() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("numa")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    lib.numa_available.restype = ctypes.c_int
    lib.numa_max_node.restype = ctypes.c_int
    if lib.numa_available() < 0:
        return None  # the kernel has no NUMA support: libnuma's calls would all fail
    lib.mbind.restype = ctypes.c_long
    lib.mbind.argtypes = [
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_uint,
    ]
    lib.set_mempolicy.restype = ctypes.c_long
    lib.set_mempolicy.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong]
    lib.move_pages.restype = ctypes.c_long
    lib.move_pages.argtypes = [
        ctypes.c_int,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    return lib


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _call(name: str, *args: int) -> None:
    """Call ``name`` through libnuma, else the raw syscall; OSError with errno on failure."""
    lib = _libnuma()
    fn: Callable[..., int]
    if lib is not None:
        fn = getattr(lib, name)
        rc = fn(*args)
    else:
        number = _SYSCALLS.get(platform.machine(), {}).get(name)
        if number is None:
            raise KvPoolError(
                ErrorCode.NOT_SUPPORTED,
                f"{name}: libnuma is not installed (apt-get install libnuma1) and kvpool "
                f"has no syscall number for {platform.machine()}",
            )
        rc = _libc().syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _nodemask(node: int) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    """A nodemask with only ``node`` set, and the ``maxnode`` to pass with it.

    The kernel reads ``maxnode - 1`` bits (a historical off-by-one libnuma compensates for the same way).
    """
    words = node // _ULONG_BITS + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // _ULONG_BITS] = 1 << (node % _ULONG_BITS)
    return mask, words * _ULONG_BITS + 1


def _mapping_address(view: memoryview) -> int:
    """The address of the mapping behind a writable memoryview (the temporary export is dropped at once)."""
    anchor = ctypes.c_char.from_buffer(view)
    address = ctypes.addressof(anchor)
    del anchor
    return address


def page_nodes(address: int, length: int, samples: int = _VERIFY_SAMPLES) -> dict[int, int]:
    """{page address: node, or -errno (-ENOENT: not faulted in yet)} for up to ``samples`` pages of the range.

    ``move_pages`` with no target nodes only reports where each page is.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = address - address % page, address + length - 1
    count = (last - first) // page + 1
    step = max(1, count // samples)
    addrs = sorted({first + i * page for i in range(0, count, step)} | {last - last % page})
    pages = (ctypes.c_void_p * len(addrs))(*addrs)
    status = (ctypes.c_int * len(addrs))()
    _call("move_pages", 0, len(addrs), ctypes.addressof(pages), 0, ctypes.addressof(status), 0)
    return dict(zip(addrs, status, strict=True))


def mapping_policy(address: int, pid: int | str = "self") -> str:
    """The policy token of the VMA holding ``address`` in ``/proc/<pid>/numa_maps`` (e.g. "bind:0")."""
    best = (-1, "")
    with open(f"/proc/{pid}/numa_maps", encoding="ascii", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 2:
                start = int(fields[0], 16)
                if best[0] < start <= address:
                    best = (start, fields[1])
    return best[1]


# ---------------------------------------------------------------------- binding
def bind_current_process(node: int) -> list[int]:
    """Run this process on ``node``'s CPUs and allocate its memory there; returns the CPUs.

    CPU affinity is set on every thread that exists now (``os.sched_setaffinity(0, ..)`` alone would only move
    the calling thread) and is inherited by threads started later. The memory policy (MPOL_BIND) is per
    thread: it applies to the calling thread and threads it starts afterwards, so call this early, before
    the serving threads start. The segment itself is bound with :func:`bind_memory`, which does not depend
    on any thread's policy.
    """
    check_node(node)
    cpus = node_cpus(node)
    if not cpus:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"NUMA node {node} has no CPUs (a memory-only node)")
    _set_affinity_all_threads(node, set(cpus))
    mask, maxnode = _nodemask(node)
    try:
        _call("set_mempolicy", MPOL_BIND, ctypes.addressof(mask), maxnode)
    except OSError as exc:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"set_mempolicy(MPOL_BIND, node {node}): {exc}") from exc
    logger.info("bound to NUMA node %d: CPUs %s, memory policy MPOL_BIND", node, format_cpus(cpus))
    return cpus


def format_cpus(cpus: list[int]) -> str:
    """CPUs as the kernel writes them ("0-3,8")."""
    return ",".join(f"{lo}-{hi}" if lo != hi else f"{lo}" for lo, hi in _runs(cpus))


def _runs(values: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


def _set_affinity_all_threads(node: int, cpus: set[int]) -> None:
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue  # the thread exited meanwhile
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise KvPoolError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"the CPUs of NUMA node {node} ({format_cpus(sorted(cpus))}) are not "
                    "allowed for this process (a cpuset or cgroup limit?)",
                ) from exc
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"sched_setaffinity to node {node}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class MemoryBinding:
    """What :func:`bind_memory` checked after binding."""

    node: int
    address: int
    length: int
    policy: str
    """The mapping's policy in numa_maps ("bind:0"), or "" when numa_maps is not readable."""
    pages_sampled: int
    pages_resident: int
    """Sampled pages already in memory - all of them on ``node``."""


def bind_memory(segment: MappedMemory, node: int) -> MemoryBinding:
    """``mbind`` the segment's mapping to ``node`` (MPOL_BIND | MPOL_MF_STRICT | MPOL_MF_MOVE), then verify.

    Pages already faulted in are moved (or the call fails: STRICT), pages faulted later come from the node.
    Verification: numa_maps shows ``bind:<node>`` for the mapping, and every sampled resident page is on the
    node (``move_pages`` query). Call before prefaulting, so that the pages are allocated there directly.
    """
    check_node(node)
    address, length = _mapping_address(segment.view), segment.size
    mask, maxnode = _nodemask(node)
    try:
        _call(
            "mbind",
            address,
            length,
            MPOL_BIND,
            ctypes.addressof(mask),
            maxnode,
            MPOL_MF_STRICT | MPOL_MF_MOVE,
        )
    except OSError as exc:
        hint = " (pages in use elsewhere could not be moved)" if exc.errno == errno.EIO else ""
        raise KvPoolError(
            ErrorCode.INVALID_ARGUMENT,
            f"mbind of {length} bytes at {address:#x} to NUMA node {node} failed: {exc}{hint}",
        ) from exc
    return _verify(address, length, node)


def _verify(address: int, length: int, node: int) -> MemoryBinding:
    expected = f"bind:{node}"
    try:
        policy = mapping_policy(address)
    except OSError:
        policy = ""
    if policy and policy != expected:
        raise KvPoolError(
            ErrorCode.INTERNAL,
            f"after mbind the mapping at {address:#x} has policy {policy!r}, not {expected!r}",
        )
    where = page_nodes(address, length)
    resident = {a: n for a, n in where.items() if n >= 0}
    strays = {a: n for a, n in resident.items() if n != node}
    if strays:
        a, n = next(iter(strays.items()))
        raise KvPoolError(
            ErrorCode.INTERNAL,
            f"after mbind {len(strays)} sampled pages are not on node {node} (page {a:#x} is on node {n})",
        )
    logger.info(
        "segment %#x (%d bytes) bound to NUMA node %d: %s, %d of %d sampled pages resident there",
        address,
        length,
        node,
        policy or "numa_maps unreadable",
        len(resident),
        len(where),
    )
    return MemoryBinding(node, address, length, policy, len(where), len(resident))


# ---------------------------------------------------------------------- hugepages
def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                value = rest.split()
                if value and value[0].isdigit():
                    out[name] = int(value[0])
    except OSError:
        pass
    return out


def hugepages_available(size: str, bytes_needed: int = 0, node: int | None = None) -> tuple[bool, str]:
    """Whether ``bytes_needed`` (at least one page) of ``size`` hugepages are free, and why (not).

    Reads the per-size pool in /sys/kernel/mm/hugepages (or the node's pool under
    /sys/devices/system/node/nodeN/hugepages when ``node`` is given), falling back to /proc/meminfo's
    HugePages_* counters for the default hugepage size.
    """
    kb = HUGEPAGE_KB.get(size)
    if kb is None:
        return False, f"hugepage size must be one of {', '.join(HUGEPAGE_KB)}, got {size!r}"
    page = kb * 1024
    needed = max(1, -(-bytes_needed // page))
    if node is None:
        base = os.path.join(HUGEPAGES_SYSFS, f"hugepages-{kb}kB")
        where = ""
    else:
        check_node(node)
        base = os.path.join(NODE_SYSFS, f"node{node}", "hugepages", f"hugepages-{kb}kB")
        where = f" on NUMA node {node}"
    total = _read_int(os.path.join(base, "nr_hugepages"))
    free = _read_int(os.path.join(base, "free_hugepages"))
    if total is None or free is None:
        info = _meminfo()
        if node is not None or info.get("Hugepagesize") != kb or "HugePages_Free" not in info:
            return False, f"this machine offers no {size} hugepages{where} ({base} does not exist)"
        total, free = info.get("HugePages_Total", 0), info["HugePages_Free"]
    if free < needed:
        wanted = f" for {bytes_needed} bytes" if bytes_needed else ""
        boot = " (1G pages are best reserved at boot: hugepagesz=1G hugepages=N)" if size == "1G" else ""
        fix = f"echo {total - free + needed} > {base}/nr_hugepages"
        return False, (
            f"{needed} free {size} hugepages needed{where}{wanted}, but {free} of {total} "
            f"reserved are free; reserve more with `{fix}`{boot}"
        )
    return True, f"{free} of {total} {size} hugepages free{where} ({needed} needed)"


def require_hugepages(size: str, bytes_needed: int, node: int | None = None) -> None:
    """Fail clearly (INVALID_ARGUMENT) unless ``bytes_needed`` of ``size`` hugepages are free: no fallback."""
    ok, reason = hugepages_available(size, bytes_needed, node)
    if not ok:
        raise KvPoolError(
            ErrorCode.INVALID_ARGUMENT,
            f"hugepages {size} were asked for and cannot be provided: {reason} "
            "(kvpool never falls back to normal pages silently)",
        )
